"""The run of a derived sweep entry (``from: LABEL`` in the sweep's schemes, sweep/spec.py): made from
its source entry's finished run of the same dataset and seed instead of training.

* no step: the source's model itself, evaluated with the entry's own ``eval:`` overrides (e.g. xPos
  with blockwise causal attention at test time, Sun et al. 2023 §3.3: ``eval: {bca: true}``);
* ``rope: {scheme: KIND, params: {...}}``: the source's RoPE weights read with another rotary kind
  (YaRN, llama3, LongRoPE, ...: training-free extension, the use those kinds were published for): its
  best checkpoint written again with the entry's model config (rotary schemes have no parameters);
* ``head_scale: {length: L, ...}`` (L: the longest eval.lengths unless given): the NoPE head scale of
  Wang et al. 2024 searched then tuned alone at L on the source's training split
  (align/head_scale_run.py, the same function as ``extrapolab align head-scale``), written as the
  entry's run folder and evaluated like any run.

The entry's results are recorded under its own label; it has no training curves of its own, and the
report's cost pass times its source's model only.
"""
from __future__ import annotations

from pathlib import Path

from .. import config as C
from ..io import UserError


def head_scale_spec(options: dict, cfg: C.RunConfig):
    """The entry's ``head_scale:`` options over the sweep's defaults: the target length is the longest
    eval.lengths, the before/after perplexity scores eval.num_tokens, the seed is the run's."""
    from ..align.head_scale_run import HeadScaleSpec

    defaults = {"length": max(cfg.eval.lengths), "seed": cfg.train.seed}
    if cfg.eval.num_tokens:
        defaults["ppl_tokens"] = cfg.eval.num_tokens
    spec = HeadScaleSpec.from_dict({**defaults, **dict(options or {})})
    if spec.length <= cfg.model.train_length:
        raise UserError(f"head_scale.length {spec.length} must exceed model.train_length={cfg.model.train_length}")
    return spec


def derive_run(out: Path, derive: dict, run_dir: Path, cfg: C.RunConfig, data) -> tuple[Path, dict]:
    """-> (the run folder whose model is evaluated, the summary recorded with the entry's results)."""
    source = Path(out) / "runs" / derive["source"]
    summary = {"derived_from": derive["source"]}
    step = derive.get("step") or {}
    if "head_scale" in step:
        from ..align.head_scale_run import head_scale_run

        spec = head_scale_spec(step["head_scale"], cfg)
        res = head_scale_run(source, spec, run_dir, device=cfg.train.device, dtype=cfg.train.precision, data=data)
        summary["head_scale"] = {k: res[k] for k in ("length", "ppl_before", "ppl_after", "seconds")}
        summary["head_scale"]["uniform_scale"] = res["search"]["best"]
        summary["head_scale"]["scale"] = res["tune"]["scale"]
        return Path(run_dir), summary
    if "rope" in step:
        from ..train.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint

        ckpt = load_checkpoint(checkpoint_path(source, "best") or checkpoint_path(source, "last"), with_state=False)
        src = ckpt.config.to_dict()  # the source's model (its vocabulary from the data) with the entry's scheme
        src["model"].update(scheme=cfg.model.scheme, scheme_params=dict(cfg.model.scheme_params))
        keep = C.from_dict(C.RunConfig, src)
        save_checkpoint(Path(run_dir) / "checkpoints" / "best", ckpt.weights, keep, None)
        summary["rope"] = {"scheme": cfg.model.scheme, "params": dict(cfg.model.scheme_params)}
        return Path(run_dir), summary
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return source, summary
