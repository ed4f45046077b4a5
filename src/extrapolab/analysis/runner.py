"""``analyze_all``: every analysis (A1-A5) of one trained run, written to ``<run>/analysis/``.

Outputs (each written atomically): ``analysis.json`` with every number, and PNG+SVG figures:
erf (A1), trf_eps (A2), bias_heatmap / exp_bias_heatmap / bias_last_row / kernels /
effective_length (A3, bias schemes; dbar_sweep for Sandwich; gates for FoX), nope_variance and
nope_cumulative_attention on the checkpoint (A4, thesis Figs. 2.6-2.7), sharpness (A5).
"""
from __future__ import annotations

import time
from pathlib import Path

from ..io import UserError, atomic_write_json
from ..model.attention import AttnOptions
from . import bias as A3
from .common import jsonable, segments_from_stream
from .compare import plot_trf_curves, trf_summary
from .erf import attention_erf, measure_erf, plot_erf
from .nope import model_variance, plot_cumulative_attention, plot_variance
from .sharpness import attention_sharpness, plot_sharpness, sharpness_table
from .theory import convergence, trf


def load_run(run_dir, which: str = "best", device="cpu"):
    """(model on ``device``, cfg) of a run, falling back to the other checkpoint when ``which`` is missing."""
    from ..train import load_model

    try:
        return load_model(run_dir, which, device)
    except UserError:
        other = "last" if which == "best" else "best"
        return load_model(run_dir, other, device)


def test_stream(cfg):
    """The 1-D token stream of the run's evaluation split."""
    from ..data import prepare

    data = prepare(cfg.data, progress=False)
    return data.split(getattr(cfg.eval, "split", "test") or "test")


def default_erf_length(cfg, n_tokens: int, want: int | None = None) -> int:
    """The ERF length for a run: ``want`` (default: its longest eval length, at most 8·L_tr and
    4096), never beyond the stream; L_tr for learned APE (no embedding beyond L_tr)."""
    L_tr = int(cfg.model.train_length)
    if cfg.model.scheme == "learned":
        return L_tr
    if want is None:
        want = min(max(list(cfg.eval.lengths) + [L_tr]), 8 * L_tr, 4096)
    return int(max(2, min(int(want), n_tokens)))


def analyze_all(run_dir, out_dir=None, *, which: str = "best", tokens=None, erf_length: int | None = None,
                segments: int = 4, eps: float = 0.01, sharp_lengths=None, max_kernel_distance: int = 2048,
                block_size: int = 256, device: str = "cpu", dtype: str = "fp32") -> dict:
    """Run A1-A5 on ``run_dir``'s checkpoint; returns the summary also saved as analysis.json.

    ``tokens`` overrides the evaluation stream (1-D ids); by default the run's prepared test split.
    ``device`` / ``dtype``: where the checkpoint runs and under which autocast (``train.placement``).
    """
    from ..train import placement

    place = placement(device, dtype)
    with place.autocast():
        return _analyze_all(run_dir, out_dir, place, which, tokens, erf_length, segments, eps, sharp_lengths,
                            max_kernel_distance, block_size)


def _analyze_all(run_dir, out_dir, place, which, tokens, erf_length, segments, eps, sharp_lengths,
                 max_kernel_distance, block_size) -> dict:
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "analysis"
    model, cfg = load_run(run_dir, which, place.device)
    stream = test_stream(cfg) if tokens is None else tokens
    L_tr = int(cfg.model.train_length)
    L_ex = int(erf_length or default_erf_length(cfg, len(stream)))
    segs = segments_from_stream(stream, L_ex, segments)
    scheme = model.scheme
    fig = lambda name: out / name  # noqa: E731
    res: dict = {"run": str(run_dir), "scheme": scheme.name, "scheme_options": scheme.options(),
                 "train_length": L_tr, "placement": place.describe(), "figures": {}}
    timings = {}

    t = time.perf_counter()  # ---- A1: cumulative gradient / ERF
    opts = AttnOptions(impl="blocked", block_size=block_size)
    e = measure_erf(model, segs, opts=opts)
    res["erf"] = {k: v for k, v in e.items() if k != "c"}
    res["erf"]["c"] = e["c"]
    res["figures"]["erf"] = plot_erf({cfg.name: e["c"]}, fig("erf"), train_length=L_tr,
                                     title=f"{cfg.name}: predicting token {L_ex}")
    res["attention_erf"] = attention_erf(model, segs, eps)
    timings["A1"] = time.perf_counter() - t

    t = time.perf_counter()  # ---- A2: convergence and TRF from the formula
    rows = trf(scheme, eps, n=2**18)
    res["theory"] = {"convergence": convergence(scheme, n=2**18), "trf": rows, "trf_summary": trf_summary(rows)}
    if scheme.has_bias:
        res["figures"]["trf_eps"], _ = plot_trf_curves({cfg.name: scheme}, fig("trf_eps"), n=2**16)
    timings["A2"] = time.perf_counter() - t

    t = time.perf_counter()  # ---- A3: bias pictures
    if scheme.has_bias:
        f = res["figures"]
        f["bias_heatmap"] = A3.plot_bias_heatmap(scheme, L_ex, fig("bias_heatmap"))
        f["exp_bias_heatmap"] = A3.plot_bias_heatmap(scheme, min(64, L_ex), fig("exp_bias_heatmap"), exp=True)
        f["bias_last_row"], fits = A3.plot_last_row_fit(scheme, L_ex, fig("bias_last_row"))
        f["kernels"] = A3.plot_kernels(scheme, fig("kernels"), max_distance=max_kernel_distance)
        effs = A3.effective_lengths(scheme)
        f["effective_length"] = A3.plot_effective_length({cfg.name: effs}, fig("effective_length"))
        res["bias"] = {"log_fits": fits, "effective_lengths": effs}
        if not scheme.relative:  # FIRE: its learned curve at several query positions, per layer and head
            f["query_curves"], _ = A3.plot_query_curves(scheme, L_ex, fig("query_curves"))
        if scheme.name == "sandwich":
            f["dbar_sweep"], res["bias"]["dbar_sweep"] = A3.plot_dbar_sweep(fig("dbar_sweep"), length=L_ex)
    elif any(scheme.for_layer(i).has_content for i in range(len(model.blocks))):  # FoX: gates on a text
        gates = A3.content_gates(model, segs[0])
        res["figures"]["gates"] = A3.plot_gates(gates, fig("gates"), title=f"{cfg.name}: forget gates")
        res["bias"] = {"gates": A3.gate_summary(gates)}
    timings["A3"] = time.perf_counter() - t

    t = time.perf_counter()  # ---- A4: variance of the attention output on the checkpoint
    var_len = min(L_tr, L_ex)
    mv = model_variance(model, segments_from_stream(stream, var_len, 2 * segments))
    res["nope_variance"] = {"length": var_len, "fits": mv["fits"], "note": "trained checkpoint, real text "
                            "(thesis §2.5, Figs. 2.6-2.7); Lemma 2.3 predicts slope -1 only for random NoPE layers"}
    res["figures"]["nope_variance"] = plot_variance({cfg.name: mv}, fig("nope_variance"), theory=False)
    res["figures"]["nope_cumulative_attention"] = plot_cumulative_attention(mv, fig("nope_cumulative_attention"))
    timings["A4"] = time.perf_counter() - t

    t = time.perf_counter()  # ---- A5: sharpness by length
    lengths = sharp_lengths or sorted({x for x in (L_tr // 2, L_tr, 2 * L_tr, 4 * L_tr) if 1 < x <= L_ex}
                                      | ({L_ex} if scheme.name != "learned" else set()))
    sh = attention_sharpness(model, segs, lengths, opts=opts)
    res["sharpness"] = sh
    res["sharpness_table"] = sharpness_table(sh)
    res["figures"]["sharpness"] = plot_sharpness(sh, fig("sharpness"), train_length=L_tr)
    timings["A5"] = time.perf_counter() - t

    res["seconds"] = timings
    res["json"] = str(out / "analysis.json")
    atomic_write_json(out / "analysis.json", jsonable(res))
    return res


def sweep_analysis(model, cfg, stream, *, length: int, segments: int = 4, eps: float = 0.01,
                   block_size: int = 256, first_token: bool = False) -> dict:
    """The light per-run analysis a sweep records next to its perplexities (``eval.erf_length``).

    A1: the cumulative gradient c [L] and ERF of predicting token ``length`` (Sandwich §5.1),
    averaged over ``segments`` segments of ``stream``; learned APE is measured at L_tr (it has no
    embedding beyond). A2 on the *trained* scheme: per-head convergence of sum exp(bias) and TRF
    n_the(eps) (Qin eq. 22). With ``first_token``, A6: the attention mass on the first token per layer
    (analysis/first_token.py) at L_tr and at ``length``, on the same segments. Returns {"erf": {...},
    "theory": {...}, "first_token": [{...}, {...}]}.
    """
    L = default_erf_length(cfg, len(stream), length)
    segs = segments_from_stream(stream, L, segments)  # [N, L]
    e = measure_erf(model, segs, opts=AttnOptions(impl="blocked", block_size=block_size))
    out = {"erf": {"length": L, "c": [float(x) for x in e["c"]], "erf_tokens": e["erf_tokens"],
                   "segments": e["segments"], "seconds": e["seconds"], "peak_memory_mb": e["peak_memory_mb"]}}
    if first_token:
        from .first_token import first_token_mass

        L_tr = int(cfg.model.train_length)
        out["first_token"] = [first_token_mass(model, segs[:, :n], block=block_size)
                              for n in sorted({min(L_tr, L), L})]
    scheme = model.scheme
    if scheme.has_bias:
        try:
            rows = trf(scheme, eps, n=2**16)
        except UserError as e:  # the theory is a side note: never lose a trained, evaluated run to it
            out["theory"] = {"error": str(e)}
            return out
        conv = [r["converges"] for r in rows]
        out["theory"] = {"eps": eps, "heads": len(rows), "converging_heads": sum(c is True for c in conv),
                         "undetermined_heads": sum(c is None for c in conv), **trf_summary(rows)}
    return out
