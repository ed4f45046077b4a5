"""`extrapolab align rope`: the RoPE context-extension methods against temperature alignment, on ONE run.

The bridge between the seeds' recency-bias view (thesis ch. 5: the attention of a model run past
L_tr is too flat; sharpen it with a softmax temperature) and the RoPE methods most users run
today. One command:

1. train (resumably, the ordinary trainer) one rotary GPT at L_tr on the corpus's train split mixed
   with passkey documents (the mixture of :mod:`.experiment`);
2. Algorithm 1 (P_max, entropy) and the length rule on that run (``<out>/run/temperature.json``);
3. for every method and every L in {L_tr} + ``rope.lengths`` (2-16x L_tr), on the same weights:
   E1 nonoverlapping perplexity on the test split, passkey exact-match accuracy per needle depth,
   and the ERF (Sandwich paper §5.1, :mod:`..analysis.erf`) of the last token at L;
4. tables (md + csv), a ppl-vs-length figure, passkey and ERF figures and ``report.html``
   (:mod:`.rope_report`), with YaRN's attention factor f next to the thesis' length rule and
   Algorithm 1's tau (YaRN multiplies the logits by f^2: an equivalent tau = 1/f^2).

Methods are applied at evaluation time by swapping the scheme (rotary has no parameters;
:mod:`.rope_methods`, the mapping `eval RUN --rope` uses too) and/or setting the softmax
temperature. Static methods use s = L/L_tr at each L, the factor a user who wants length L would set. ``rope`` plain RoPE; ``pi`` position interpolation (Chen et al. 2023);
``ntk`` NTK-aware base (bloc97 2023); ``dynamic`` dynamic NTK (s from the current length, the
same scheme at every L); ``yarn`` YaRN (Peng et al. 2023) and ``yarn-ramp`` its frequencies
without its temperature; ``pmax``, ``entropy`` Algorithm 1's tau; ``length`` tau = log L_tr / log L;
the two-pass methods (positional/rope_twopass.py, ``default_settings``): ``selfextend`` (Jin et al.
2024; w = L_tr/4, the smallest G whose (L_tr - w)·G + w covers L, so G = 1 = plain RoPE at L_tr;
the cell records that maximum length), ``rerope`` and ``rerope-leaky`` (Su 2023; w = L_tr/8, k = 16,
with log-n scaling as in the ReRoPE patches); ``dca`` dual chunk attention (An et al. 2024; C = 3/4·L_tr,
w = C/6, as ChunkLlama; without its Hugging Face patch's q, k scaling beyond L_tr, as vLLM's DCA); ``streaming`` StreamingLLM's 4 sinks + a window of L_tr - 4 (Xiao et al. 2024,
positional/rotary_streaming.py); ``logn`` plain RoPE with log-n scaling of q.
Every stage is stored as JSON keyed by the trained model and its settings, so a run resumes.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import config as C
from ..analysis.erf import measure_erf
from ..data import provenance
from ..eval.perplexity import nonoverlapping
from ..io import UserError, atomic_write_json
from ..model.attention import AttnOptions
from ..report.stages import Stages, sayer
from ..tasks.retrieval import make_examples, score
from .algorithm import align, save_temperature
from .experiment import rule_taus, sorted_lengths, train_on_mixture
from .rope_methods import METHODS, method_setup, swapped
from .rope_report import LABELS, write_rope_report
from .temperature import temperature_scope


@dataclass
class RopeSpec:
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048])  # L_ex (> L_tr)
    methods: list[str] = field(default_factory=lambda: ["rope", "pi", "ntk", "dynamic", "yarn", "yarn-ramp",
                                                        "pmax", "length"])
    task_mix: str = "passkey"  # retrieval documents in the training mixture (see align.experiment)
    task_ratio: float = 1.0
    corpus_tokens: int = 0
    depths: list[float] = field(default_factory=lambda: [0.0, 0.5, 1.0])
    n: int = 4  # passkey examples per (length, depth)
    segments: int = 4  # Algorithm 1 sequences per length
    propagate: bool = True
    ppl_tokens: int = 16384  # tokens scored per (method, length); 0 = the whole test split
    erf_segments: int = 2  # ERF sequences per (method, length); 0 = no ERF
    seed: int = 1
    batch_size: int = 8
    budget: str = ""


def load_rope_preset(name_or_path: str, overrides: list[str] | None = None) -> tuple[C.RunConfig, RopeSpec]:
    cfg, spec = C.load_study_preset(name_or_path, overrides, "rope", RopeSpec)
    L_tr = cfg.model.train_length
    if cfg.model.scheme != "rotary":
        raise UserError(f"align rope studies a plain rotary run; set model.scheme=rotary (got {cfg.model.scheme!r})")
    spec.lengths = sorted_lengths(spec.lengths, L_tr, "rope")
    bad = [m for m in spec.methods if m not in METHODS]
    if bad:
        raise UserError(f"unknown rope.methods {bad}; choose from {', '.join(METHODS)}")
    if spec.n < 1 or spec.segments < 1 or any(not 0 <= d <= 1 for d in spec.depths):
        raise UserError("rope.n and rope.segments must be >= 1 and rope.depths in [0, 1]")
    return cfg, spec


def evaluate_method(model, method: str, L_tr: int, lengths: list[int], taus: dict, tokens, spec: RopeSpec,
                    tokenizer, batch_size: int) -> dict:
    """{str(L): {"tau", "factor", "ppl", "passkey": [records], "erf"}} for one method."""
    out: dict = {}
    for L in lengths:
        scheme, tau = method_setup(method, L_tr, L, model.cfg.heads, taus)
        cell: dict = {"tau": tau, "scheme": scheme.name, "options": scheme.options()}
        if hasattr(scheme, "max_length"):  # Self-Extend: (L_tr - w)·G + w
            cell["max_length"] = scheme.max_length()
        if tau is None:
            out[str(L)] = cell
            continue
        opts = dataclasses.replace(getattr(model, "attn_opts", None) or AttnOptions(), temperature=tau)
        with swapped(model, scheme), torch.inference_mode():
            cell["ppl"] = nonoverlapping(model, tokens, L, max_tokens=spec.ppl_tokens, batch_size=batch_size,
                                         opts=opts)["ppl"]
            ex = make_examples("passkey", [L], spec.depths, spec.n, spec.seed, tokenizer=tokenizer, preamble=False)
            cell["passkey"] = [{k: r[k] for k in ("depth", "correct", "pred", "answer")}
                               for r in score(model, ex, tau, spec.batch_size, method, scope=temperature_scope)]
        if spec.erf_segments > 0:
            rng = np.random.default_rng(spec.seed)
            starts = rng.integers(0, len(tokens) - L - 1, size=spec.erf_segments)
            segs = np.stack([np.asarray(tokens[s:s + L + 1]) for s in starts]).astype(np.int64)  # [N, L+1]
            with swapped(model, scheme):
                e = measure_erf(model, segs, opts=AttnOptions(impl="blocked", block_size=512, temperature=tau))
            cell["erf_tokens"], cell["erf_c"] = e["erf_tokens"], [float(x) for x in e["c"]]
        out[str(L)] = cell
    return out


def run_rope_study(preset: str, out: Path | None = None, overrides: list[str] | None = None,
                   progress: bool = True) -> dict:
    """Train, align, evaluate every method, write the report; returns {"report", "wall_s", "out", "results"}."""
    t0 = time.time()
    cfg, spec = load_rope_preset(preset, overrides)
    out = Path(out) if out else Path(cfg.out_dir) / cfg.name
    say = sayer(progress)
    L_tr = cfg.model.train_length
    data, sizes, run_dir, summary, train_wall, model, place = train_on_mixture(cfg, spec, out, "rope-spec.json",
                                                                               say, progress)
    tokens = data.split(cfg.eval.split)
    stages = Stages(out, {k: summary.get(k) for k in ("steps", "best_step", "best_valid_loss", "params")}, say,
                     place.autocast)
    a_set = {"lengths": spec.lengths, "segments": spec.segments, "propagate": spec.propagate, "seed": cfg.train.seed}
    res = stages.run("align", a_set, lambda: align(model, tokens, L_tr, spec.lengths, n_segments=spec.segments,
                                                  propagate=spec.propagate, seed=cfg.train.seed, progress=say))
    res.update(run=cfg.name, scheme=cfg.model.scheme, split=cfg.eval.split)
    save_temperature(run_dir, res)
    lengths = [L_tr, *spec.lengths]
    taus = {r: {int(L): v for L, v in row.items()} for r, row in rule_taus(run_dir, ["pmax", "entropy", "length"],
                                                                            lengths).items()}
    methods = {}
    for m in spec.methods:
        say(f"{LABELS[m]}: perplexity, passkey, ERF at {lengths}")
        m_set = {k: getattr(spec, k) for k in ("ppl_tokens", "depths", "n", "seed", "erf_segments")} | {
            "lengths": lengths, "taus": {L: taus.get(METHODS[m][2] or "", {}).get(L) for L in lengths}}
        methods[m] = stages.run(f"method-{m}", m_set, lambda m=m: evaluate_method(
            model, m, L_tr, lengths, taus, tokens, spec, data, cfg.eval.batch_size))
    wall = time.time() - t0
    results = {"preset": str(preset), "budget": spec.budget, "spec": dataclasses.asdict(spec),
               "config": cfg.to_dict(), "train": summary, "mixture": sizes, "align": res,
               "taus": {r: {str(L): v for L, v in row.items()} for r, row in taus.items()}, "methods": methods,
               "wall_s": wall, "train_wall_s": train_wall, "stage_seconds": stages.seconds,
               "data": provenance(data)}  # which text of the corpus (data/origin.py)
    atomic_write_json(out / "results.json", results)
    report = write_rope_report(out, results)
    say(f"report: {report} (wall time {wall:.0f} s)")
    return {"report": report, "wall_s": wall, "out": out, "results": results}
