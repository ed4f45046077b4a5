"""`extrapolab analyze <what>`: thin wrappers over ``extrapolab.analysis`` (docs/protocols.md, A1-A5)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from .common import ROPE_HELP, DeviceOpt, DtypeOpt, friendly

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="analysis tools: erf, trf, bias, nope-variance, sharpness, all")

ParamOpt = typer.Option(None, "--param", help="scheme option key=value, e.g. --param shift=2 (repeatable)")


def _params(items: Optional[List[str]]) -> dict:
    import yaml

    from ..io import UserError

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--param expects key=value, got {item!r}; e.g. --param dbar=128")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _lengths(text: Optional[str]) -> Optional[list[int]]:
    from ..io import UserError

    if not text:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--lengths must be comma-separated integers, got {text!r}") from None


def _echo(obj, as_json: bool, lines: list[str]) -> None:
    from ..analysis.common import jsonable

    typer.echo(json.dumps(jsonable(obj), indent=2) if as_json else "\n".join(lines))


@app.command()
@friendly
def erf(
    runs: List[str] = typer.Argument(..., help="run folders and/or hf:PATH models (overlaid in one figure)"),
    length: Optional[int] = typer.Option(None, "--length", help="L_ex: tokens per segment incl. the predicted one"),
    segments: int = typer.Option(4, "--segments", help="N segments averaged"),
    threshold: float = typer.Option(0.99, "--threshold"),
    eps: float = typer.Option(0.01, "--eps", help="eps of the TRF and of the attention ERF"),
    out: Path = typer.Option(Path("reports/analysis"), "--out", help="figure folder"),
    as_json: bool = typer.Option(False, "--json"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="hf: only: data.* override, e.g. --set data.corpus=pydoc"),
    rope: Optional[str] = typer.Option(None, "--rope", help=ROPE_HELP),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
):
    """A1: cumulative normalized gradient and ERF of trained runs and hf:PATH models; TRF-vs-ERF figure (Qin Figs. 5-6)."""
    from ..analysis import attention_erf, measure_erf, plot_erf, plot_trf_vs_erf, trf, trf_summary
    from ..analysis.common import segments_from_stream
    from ..analysis.runner import default_erf_length, load_run, test_stream
    from ..io import UserError
    from ..train import placement

    if rope and not any(r.startswith("hf:") for r in runs):
        raise UserError("--rope applies to the hf: models of `analyze erf`, and none is given; drop --rope")
    place = placement(device, dtype)
    curves, records, lines = {}, [], []
    L_tr = None
    for run in runs:
        if run.startswith("hf:"):
            from ..hf.erf import erf_of_hf

            rec, curves_c, L_tr = erf_of_hf(run, length=length, segments=segments, threshold=threshold,
                                            overrides=set_, device=device, dtype=dtype, rope=rope)
            curves[rec["name"]] = curves_c
            records.append(rec)
            lines.append(f"{rec['name']}: ERF {rec['erf_tokens']} tokens (position {rec['erf_position']} of "
                         f"{rec['L_ex']}), peak {rec['peak_memory_mb']:.0f} MB, {rec['seconds']:.1f} s")
            continue
        model, cfg = load_run(Path(run), device=place.device)
        stream = test_stream(cfg)
        L = length or default_erf_length(cfg, len(stream))
        segs = segments_from_stream(stream, L, segments)
        with place.autocast():
            e = measure_erf(model, segs, threshold=threshold)
            att = attention_erf(model, segs, eps)["mean"]
        name = f"{cfg.name} ({cfg.model.scheme})"
        curves[name] = e["c"]
        L_tr = cfg.model.train_length
        rec = {"name": name, "erf_tokens": e["erf_tokens"], "erf_position": e["erf_position"], "L_ex": L,
               "peak_memory_mb": e["peak_memory_mb"], "seconds": e["seconds"], "attention_erf": att,
               "trf": trf_summary(trf(model.scheme, eps, n=2**18))["mean"]}
        records.append(rec)
        lines.append(f"{name}: ERF {rec['erf_tokens']} tokens (position {rec['erf_position']} of {L}), "
                     f"attention n_emp {rec['attention_erf']:.1f}, TRF {rec['trf']}, "
                     f"peak {rec['peak_memory_mb']:.0f} MB, {rec['seconds']:.1f} s")
    figs = plot_erf(curves, out / "erf", train_length=L_tr, threshold=threshold)
    figs += plot_trf_vs_erf(records, out / "trf_vs_erf")
    _echo({"runs": records, "figures": figs}, as_json, lines + [f"wrote {', '.join(figs)}"])


@app.command("trf")
@friendly
def trf_cmd(
    scheme: str = typer.Argument(..., help="scheme name (or bias:module:fn / b:file.py:fn)"),
    eps: float = typer.Option(0.01, "--eps"),
    heads: int = typer.Option(8, "--heads", help="number of heads H"),
    param: Optional[List[str]] = ParamOpt,
    layer: int = typer.Option(0, "--layer"),
    n: int = typer.Option(2**20, "--n", help="dense terms of the numeric test (power of two)"),
    as_json: bool = typer.Option(False, "--json"),
    figure: Optional[Path] = typer.Option(None, "--figure", help="also write TRF-vs-eps figure (path stem)"),
):
    """A2: per head, does sum exp(bias) converge (Qin Thm. 0.4) and the TRF n_the(eps) (eq. 22)."""
    from .. import positional
    from ..analysis import plot_trf_curves, trf

    s = positional.build(scheme, num_heads=heads, **_params(param))
    keep = ("head", "converges", "trf", "B", "tail_bound", "method", "trf_lower_bound")
    rows = [{k: r[k] for k in keep if k in r} for r in trf(s, eps, layer=layer, n=n)]
    lines = [f"{scheme}, eps={eps}:"] + [
        f"  head {r['head']}: converges={r['converges']} TRF={r['trf']} B={r['B']:.6g}  [{r['method']}]" for r in rows]
    if figure:
        files, _ = plot_trf_curves({scheme: s}, figure, n=min(n, 2**18))
        lines.append(f"wrote {', '.join(files)}")
    _echo(rows, as_json, lines)


@app.command("bias")
@friendly
def bias_cmd(
    scheme: Optional[str] = typer.Argument(None, help="scheme name (omit with --run)"),
    run: Optional[Path] = typer.Option(None, "--run", help="read the (learned) scheme from this run's checkpoint"),
    heads: int = typer.Option(8, "--heads"),
    param: Optional[List[str]] = ParamOpt,
    length: int = typer.Option(8192, "--length", help="matrix size / last-row query m + 1"),
    head: Optional[List[int]] = typer.Option(None, "--head", help="heads to draw (repeatable; default all)"),
    out: Path = typer.Option(Path("reports/analysis"), "--out"),
    as_json: bool = typer.Option(False, "--json"),
):
    """A3: bias heat map, exp(bias) heat map, last row + log fit, kernels, effective length."""
    from .. import positional
    from ..analysis import bias as A3
    from ..analysis.runner import load_run
    from ..io import UserError

    if run is not None:
        model, cfg = load_run(run)
        s, name = model.scheme, cfg.model.scheme
    elif scheme:
        s, name = positional.build(scheme, num_heads=heads, **_params(param)), scheme
    else:
        raise UserError("give a scheme name or --run RUN_DIR")
    if s.has_content:  # FoX: the bias depends on the text, drawn from the run's gates on its test split
        if run is None:
            raise UserError(f"{name}'s bias depends on the text (its forget gates); give --run RUN_DIR to draw "
                            "the gates of a trained model on its test split")
        from ..analysis.common import segments_from_stream
        from ..analysis.runner import test_stream

        gates = A3.content_gates(model, segments_from_stream(test_stream(cfg), min(length, 2048), 1))
        figs = A3.plot_gates(gates, out / f"{name}_gates")
        summary = A3.gate_summary(gates)
        lines = [f"layer {k} mean gate per head {v['mean_gate']}, effective lengths {v['effective_lengths']}"
                 for k, v in summary.items()] + [f"wrote {len(figs)} files to {out}"]
        _echo({"scheme": name, "gates": summary, "figures": figs}, as_json, lines)
        return
    figs = A3.plot_bias_heatmap(s, length, out / f"{name}_bias_heatmap", heads=head)
    figs += A3.plot_bias_heatmap(s, min(length, 64), out / f"{name}_exp_bias_heatmap", heads=head, exp=True)
    f, fits = A3.plot_last_row_fit(s, length, out / f"{name}_last_row", heads=head)
    figs += f + A3.plot_kernels(s, out / f"{name}_kernels", max_distance=min(length, 4096))
    effs = A3.effective_lengths(s)
    figs += A3.plot_effective_length({name: effs}, out / f"{name}_effective_length")
    result = {"scheme": name, "log_fits": fits, "effective_lengths": effs}
    if not s.relative:  # FIRE: the curve moves with the query position
        f, _ = A3.plot_query_curves(s, length, out / f"{name}_query_curves", heads=head)
        figs += f
    if name == "sandwich":
        f, result["dbar_sweep"] = A3.plot_dbar_sweep(out / "sandwich_dbar_sweep", length=length)
        figs += f
    result["figures"] = figs
    lines = [f"head {x['head']}: log fit a={x['a']:.4f} b={x['b']:.4f} (rmse {x['rmse']:.3g})" for x in fits]
    lines += [f"effective lengths (first k with bias < -2): {effs}", f"wrote {len(figs)} files to {out}"]
    _echo(result, as_json, lines)


@app.command("nope-variance")
@friendly
def nope_variance(
    dim: int = typer.Option(768, "--dim"), heads: int = typer.Option(12, "--heads"),
    length: int = typer.Option(512, "--length"), sigma: float = typer.Option(0.02, "--sigma"),
    samples: int = typer.Option(500, "--samples"), layers: int = typer.Option(1, "--layers"),
    sweep: bool = typer.Option(True, "--sweep/--no-sweep", help="sigma in 0.2, 0.02, 0.002 (Fig. 2.5)"),
    probe: bool = typer.Option(False, "--probe/--no-probe", help="position probe (Fig. 2.2)"),
    probe_layers: int = typer.Option(12, "--probe-layers"),
    probe_samples: int = typer.Option(96, "--probe-samples", help="random sequences fitting the probe"),
    probe_eval: int = typer.Option(8, "--probe-eval", help="held-out sequences measuring it"),
    probe_kind: str = typer.Option("mlp", "--probe-kind", help="mlp (thesis §2.8.1, Adam) | linear (ridge)"),
    probe_steps: int = typer.Option(700, "--probe-steps", help="Adam steps of the mlp probe (batch 512 rows)"),
    run: Optional[Path] = typer.Option(None, "--run", help="also measure this trained checkpoint (Figs. 2.6-2.7)"),
    out: Path = typer.Option(Path("reports/analysis"), "--out"),
    as_json: bool = typer.Option(False, "--json"),
    device: str = DeviceOpt,
    dtype: str = typer.Option("fp32", "--dtype", help="fp32 | bf16 | auto (fp32 default: a variance of ~1e-10 "
                              "at sigma=0.002 is below bf16's resolution)"),
):
    """A4: Var(o_m) vs m in a random frozen NoPE model against Lemma 2.3 (d^2 sigma^4 / m)."""
    from ..train import placement

    place = placement(device, dtype)
    with place.autocast():
        probe_kw = dict(layers=probe_layers, train_samples=probe_samples, eval_samples=probe_eval, kind=probe_kind,
                        steps=probe_steps) if probe else None
        _nope_variance(dim, heads, length, sigma, samples, layers, sweep, probe_kw, run, out, as_json, place.device)


def _nope_variance(dim, heads, length, sigma, samples, layers, sweep, probe_kw, run, out, as_json, device):
    from ..analysis import nope, nope_probe
    from ..analysis.common import segments_from_stream
    from ..analysis.runner import load_run, test_stream

    res = nope.simulate_variance(dim, heads, length, sigma, samples, layers, device=device)
    figs = nope.plot_variance({f"sigma={sigma}": res}, out / "nope_variance_random")
    result = {"random": {"fits": res["fits"], "theory_at_1": res["theory"][0]}}
    lines = [f"layer {i}: log-log slope {f['slope']:.3f} (Lemma 2.3: -1)" for i, f in enumerate(res["fits"])]
    if sweep:
        sw = nope.sigma_sweep(dim=dim, heads=heads, length=length, samples=max(1, samples // 5), device=device)
        figs += nope.plot_variance({f"sigma={s}": r for s, r in sw.items()}, out / "nope_sigma_sweep", layer=0)
        result["sigma_sweep"] = {str(s): r["fits"][0] for s, r in sw.items()}
        lines += [f"sigma={s}: slope {r['fits'][0]['slope']:.3f}" for s, r in sw.items()]
    if probe_kw:
        pr = nope_probe.position_probe(dim, heads, length, sigma, device=device, **probe_kw)
        figs += nope_probe.plot_probe(pr, out / "nope_position_probe", variance=res)
        result["probe"] = {"mae_per_layer": pr["mae_per_layer"], "baseline_mae": pr["baseline_mae"]}
        lines.append(f"probe MAE per layer {[round(float(x), 1) for x in pr['mae_per_layer']]} "
                     f"(midpoint baseline {pr['baseline_mae']:.0f})")
    if run is not None:
        model, cfg = load_run(run, device=device)
        mv = nope.model_variance(model, segments_from_stream(test_stream(cfg), min(length, cfg.model.train_length), 16))
        figs += nope.plot_variance({cfg.name: mv}, out / "nope_variance_trained", theory=False)
        figs += nope.plot_cumulative_attention(mv, out / "nope_cumulative_attention")
        result["trained"] = {"fits": mv["fits"]}
        lines += [f"trained layer {i}: slope {f['slope']:.3f}" for i, f in enumerate(mv["fits"])]
    result["figures"] = figs
    _echo(result, as_json, lines + [f"wrote {len(figs)} files to {out}"])


@app.command()
@friendly
def sharpness(
    run: Path = typer.Argument(..., help="run folder"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="comma-separated, default L_tr/2..4·L_tr"),
    segments: int = typer.Option(4, "--segments"),
    queries: str = typer.Option("all", "--queries", help="all | last"),
    temperature: float = typer.Option(1.0, "--temperature"),
    out: Path = typer.Option(Path("reports/analysis"), "--out"),
    as_json: bool = typer.Option(False, "--json"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
):
    """A5: mean max attention probability and entropy per layer at each length (thesis Table 5.1)."""
    from ..analysis import attention_sharpness, plot_sharpness, sharpness_table
    from ..analysis.common import segments_from_stream
    from ..analysis.runner import load_run, test_stream
    from ..model.attention import AttnOptions
    from ..train import placement

    place = placement(device, dtype)
    model, cfg = load_run(run, device=place.device)
    L_tr = cfg.model.train_length
    Ls = _lengths(lengths) or [x for x in (L_tr // 2, L_tr, 2 * L_tr, 4 * L_tr) if x > 1]
    segs = segments_from_stream(test_stream(cfg), max(Ls), segments)
    with place.autocast():
        res = attention_sharpness(model, segs, Ls, opts=AttnOptions(temperature=temperature), queries=queries)
    res["figures"] = plot_sharpness(res, out / "sharpness", train_length=L_tr)
    _echo(res, as_json, [sharpness_table(res), f"wrote {', '.join(res['figures'])}"])


@app.command()
@friendly
def compare(
    runs: List[Path] = typer.Argument(..., help="runs already analysed with `analyze all`"),
    out: Path = typer.Option(Path("reports/analysis"), "--out"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Cross-run figures from stored analysis.json records: c_m overlay, TRF vs ERF, effective lengths."""
    from ..analysis import compare_runs

    res = compare_runs(runs, out)
    lines = [f"{r['name']}: ERF {r['erf_tokens']} tokens, attention n_emp {r['attention_erf']}, TRF {r['trf']}"
             for r in res["runs"]]
    _echo(res, as_json, lines + [f"wrote {', '.join(res['figures'])}"])


@app.command("all")
@friendly
def all_cmd(
    run: Path = typer.Argument(..., help="run folder"),
    out: Optional[Path] = typer.Option(None, "--out", help="default <run>/analysis"),
    length: Optional[int] = typer.Option(None, "--length", help="L_ex for the ERF and bias pictures"),
    segments: int = typer.Option(4, "--segments"),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
):
    """Every analysis of one run: figures + analysis.json in <run>/analysis/."""
    from ..analysis import analyze_all

    res = analyze_all(run, out, erf_length=length, segments=segments, device=device, dtype=dtype)
    e = res["erf"]
    typer.echo(f"ERF {e['erf_tokens']} tokens at L_ex={e['L_ex']} (peak {e['peak_memory_mb']:.0f} MB)")
    typer.echo(res["sharpness_table"])
    typer.echo(f"wrote {res['json']}")
