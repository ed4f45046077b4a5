"""`extrapolab eval RUN`: evaluate one trained run with the protocols E1-E6 and write eval.json.

``--rope TEXT`` evaluates a run trained with plain ``rotary`` with that extension swapped in (the
mapping of `align rope`, align/rope_methods.py) and writes ``eval-rope-<tag>.json`` beside the plain
``eval.json``; on an ``hf:`` model it is applied when the model is loaded (hf/load.py) and named the
same way. Before anything runs, the CLI is told which lengths will run and why (L_tr is added as the
verdict's reference only when some length exceeds it: ``eval.eval_lengths``).
"""
from __future__ import annotations

from pathlib import Path

from .. import config as C
from ..data.origin import corpus_line, provenance
from ..io import UserError, atomic_write_json


def _lengths(spec: str | None) -> list[int] | None:
    if not spec:
        return None
    try:
        out = [int(x) for x in str(spec).replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--lengths must be comma-separated integers like 128,256,1024, got {spec!r}") from None
    if not out or min(out) < 1:
        raise UserError(f"--lengths must be positive integers, got {spec!r}")
    return out


def _temperature(spec: str, run: Path, lengths: list[int]) -> float | dict:
    if spec != "auto":
        try:
            tau = float(spec)
        except ValueError:
            raise UserError(f"--temperature must be a number or 'auto', got {spec!r}") from None
        if not 0 < tau <= 10:
            raise UserError(f"--temperature must be in (0, 10], got {tau}")
        return tau
    from ..align import load_temperature

    return {L: load_temperature(run, L) for L in lengths}


def result_name(temperature: str, rope: str | None = None, bca: bool = False) -> str:
    """eval.json, or the file of an evaluation that is not the plain one (nothing overwrites another):
    ``eval[-rope-<tag>][-temperature-<tau>][-bca].json``."""
    from ..hf.load import rope_tag

    name = "eval" + (f"-rope-{rope_tag(rope)}" if rope else "")
    name += "" if temperature in ("1", "1.0") else f"-temperature-{temperature}"
    return name + ("-bca" if bca else "") + ".json"


def _run_rope(cfg, rope: str):
    """The scheme ``--rope`` swaps onto a run trained with plain rotary, or a one-line refusal."""
    from ..align.rope_methods import rope_scheme
    from ..hf.load import parse_rope

    parse_rope(rope)  # an unknown kind or a bad number fails first, whatever the run
    m = cfg.model
    if m.arch != "gpt" or m.scheme != "rotary":
        what = "RegularGPT" if m.arch != "gpt" else f"scheme {m.scheme!r}"
        raise UserError(f"--rope extends a run trained with plain rotary; {cfg.name} uses {what}: drop --rope")
    return rope_scheme(rope, m.heads, m.train_length, m.scheme_params)


def eval_run(run: str | Path, *, protocols=None, lengths=None, temperature: str = "1.0",
             overrides=None, which: str = "best", device: str = "auto", dtype: str = "auto",
             rope: str | None = None, say=None) -> dict:
    """Evaluate ``run`` on ``device`` under ``dtype`` autocast (train.placement rules; recorded in eval.json);
    ``rope``: an extension swapped onto a plain rotary run (module doc); ``say``: told what will run."""
    from contextlib import nullcontext

    from ..align.rope_methods import swapped
    from ..data import prepare
    from ..eval import eval_lengths, evaluate_config
    from ..train import load_model, placement

    run = Path(run)
    if not (run / "config.yaml").is_file():
        raise UserError(f"{run} is not a run folder (no config.yaml); pass a folder made by `extrapolab train`")
    cfg = C.load(run / "config.yaml")
    if overrides:
        cfg = C.resolve(base=C.apply_overrides(cfg.to_dict(), overrides))
    ecfg = cfg.eval
    if protocols:
        ecfg.protocols = list(protocols)
    ecfg.lengths = _lengths(lengths) or ecfg.lengths
    scheme = _run_rope(cfg, rope) if rope else None
    place = placement(device, dtype)
    model, _ = load_model(run, which=which, device=place.device)
    model.eval()
    data = prepare(cfg.data, progress=False)
    tokens = data.split(ecfg.split)
    tau = _temperature(temperature, run, ecfg.lengths)
    say = say or (lambda _m: None)
    say(f"evaluating {eval_lengths(ecfg.lengths, cfg.model.train_length)[1]}")
    if scheme is not None:
        say(f"--rope {rope}: {scheme.name} {scheme.options()} in place of the run's rotary")

    def run_fn(e):
        with place.autocast(), swapped(model, scheme) if scheme is not None else nullcontext():
            return evaluate_config(model, tokens, e, cfg.model.train_length, positions=C.eval_positions(cfg))

    res, md = _evaluate_taus(tau, ecfg, run_fn)
    res["placement"] = place.describe()
    res["data"] = provenance(data)  # which text of the corpus this measured (data/origin.py)
    md = corpus_line(res["data"], cfg.data.corpus) + "\n\n" + md
    if scheme is not None:
        res["rope"] = {"text": rope, "scheme": scheme.name, "options": scheme.options()}
    name = result_name(temperature, rope, ecfg.bca)  # bca: blockwise causal attention, its own file too
    atomic_write_json(run / name, res)
    return {"result": res, "markdown": md, "path": run / name}


def _evaluate_taus(tau, ecfg, run_fn) -> tuple[dict, str]:
    """``run_fn(ecfg)`` at one temperature, or once per length with the per-length tau of `align`."""
    if isinstance(tau, dict):  # per-length temperature chosen by `extrapolab align`
        results = {}
        for L, t in tau.items():
            ecfg.temperature = t
            results[L] = run_fn(_only(ecfg, L))
        res = {"per_length_temperature": {str(k): v for k, v in tau.items()}, "runs": results}
        return res, "\n".join(f"L={L} τ={tau[L]}: " + _ppl_line(r) for L, r in results.items())
    ecfg.temperature = tau
    res = run_fn(ecfg)
    return res, markdown_summary(res)


def eval_hf(spec: str, *, protocols=None, lengths=None, temperature: str = "1.0", overrides=None,
            preset: str | None = None, out: str | Path | None = None, device: str = "auto", dtype: str = "auto",
            rope: str | None = None, train_length: int | None = None, say=None) -> dict:
    """`extrapolab eval hf:PATH`: E1-E4 on a local HF causal LM over our corpus (data.* / eval.* of the
    preset and --set), tokenized with the model's tokenizer; writes OUT/eval.json (module doc)."""
    from ..eval import eval_lengths
    from ..hf import check_hf_lengths, check_hf_protocols, default_out, evaluate_hf, hf_split, open_hf

    cfg = C.resolve(preset, overrides)
    ecfg = cfg.eval
    ecfg.protocols = check_hf_protocols(list(protocols) if protocols else ecfg.protocols)
    ecfg.lengths = _lengths(lengths) or ecfg.lengths
    model = open_hf(spec, device=device, dtype=dtype, rope=rope, train_length=train_length,
                    cache_dir=cfg.data.cache_dir)
    L_tr = model.loaded.train_length
    if not L_tr:
        raise UserError(f"{spec} names no pre-training length in its config; pass --train-length")
    run_lengths, why = eval_lengths(ecfg.lengths, L_tr)
    check_hf_lengths(model, run_lengths)
    tokens = hf_split(cfg.data, model.loaded.tokenizer, ecfg.split)
    out = Path(out) if out else default_out(model.loaded)
    out.mkdir(parents=True, exist_ok=True)
    if temperature == "auto" and not (out / "temperature.json").is_file():
        raise UserError(f"no temperature.json in {out}; run `extrapolab align {spec} --out {out} --lengths ...` first")
    tau = _temperature(temperature, out, ecfg.lengths)
    (say or (lambda _m: None))(f"evaluating {why}")
    res, md = _evaluate_taus(tau, ecfg, lambda e: evaluate_hf(model, tokens, e, L_tr))
    name = result_name(temperature, rope)
    atomic_write_json(out / name, res)
    return {"result": res, "markdown": md, "path": out / name}


def _only(ecfg, L):
    import copy

    e = copy.deepcopy(ecfg)
    e.lengths = [L]
    return e


def _ppl_line(res: dict) -> str:
    return "; ".join(f"{p}: " + ", ".join(f"{L}={v:.3f}" if isinstance(v, (int, float)) else f"{L}=—"
                                          for L, v in t.items()) for p, t in (res.get("ppl") or {}).items())


def markdown_summary(res: dict) -> str:
    ppl = res.get("ppl") or {}
    lengths = res.get("lengths") or []
    lines = ["| protocol | " + " | ".join(str(L) for L in lengths) + " | verdict |",
             "|---" * (len(lengths) + 2) + "|"]
    for p, t in ppl.items():
        v = (res.get("verdict") or {}).get(p, {})
        verdict = ("extrapolates" if v.get("extrapolates") else "does not extrapolate") if "extrapolates" in v else "—"
        cells = [f"{t.get(str(L)):.3f}" if isinstance(t.get(str(L)), (int, float)) else "—" for L in lengths]
        lines.append(f"| {p} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines)
