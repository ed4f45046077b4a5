"""What one sweep run leaves in results.sqlite: its evaluation (E1-E6, and the A1 ERF / A2 TRF of its
trained scheme when ``eval.erf_length`` > 0) flattened to scalar and series rows, and its training
curves (report/curves.py reads them back)."""
from __future__ import annotations

import time
from pathlib import Path

from .. import config as C
from ..data.origin import provenance


def evaluate_run_dir(run_dir: Path, cfg: C.RunConfig, data, model_dir: Path | None = None) -> tuple[list, list, dict]:
    """Evaluate a trained run with cfg.eval; flatten to DB rows (scalars, series) + cost extras.
    ``model_dir``: the run folder whose model to load (a derived entry evaluates its source's model);
    the results are written into ``run_dir`` either way."""
    from ..eval import evaluate_config
    from ..train import load_model, run_placement

    place = run_placement(cfg.train)  # evaluate where (and in the precision) the run trained
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    model, _ = load_model(model_dir or run_dir, which="best", device=place.device)
    model.eval()
    tokens = data.split(cfg.eval.split)
    t = time.time()
    with place.autocast():
        res = evaluate_config(model, tokens, cfg.eval, cfg.model.train_length, positions=C.eval_positions(cfg))
    from ..io import atomic_write_json

    atomic_write_json(Path(run_dir) / "eval.json", res)
    extra = {"eval_wall_s": time.time() - t, "data": provenance(data)}  # the corpus measured (report/corpora.py)
    scalars, series = flatten_eval(res)
    if cfg.eval.erf_length:  # A1 ERF + A2 TRF of the trained scheme, recorded like any protocol
        from ..analysis.runner import sweep_analysis

        t = time.time()
        with place.autocast():
            an = sweep_analysis(model, cfg, tokens, length=cfg.eval.erf_length, segments=cfg.eval.erf_segments,
                                eps=cfg.eval.trf_eps, first_token=cfg.eval.first_token)
        atomic_write_json(Path(run_dir) / "analysis.json", an)
        extra["analysis_wall_s"] = time.time() - t
        e = an["erf"]
        scalars.append(("erf", e["length"], "erf_tokens", float(e["erf_tokens"])))
        series.append(("erf", e["length"], "c", e["c"]))
        for ft in an.get("first_token") or []:  # A6: per layer, and its mean over layers
            series.append(("first_token", ft["length"], "mass", ft["per_layer"]))
            scalars.append(("first_token", ft["length"], "mass", float(sum(ft["per_layer"]) / len(ft["per_layer"]))))
        th = an.get("theory")
        if th and "error" not in th:
            scalars.append(("trf", 0, "converging_heads", float(th["converging_heads"])))
            scalars.append(("trf", 0, "heads", float(th["heads"])))
            for k in ("mean", "max"):
                if th.get(k) is not None:
                    scalars.append(("trf", 0, f"trf_{k}", float(th[k])))
    scored = sum(v.get("tokens", 0) for v in (res.get("nonoverlapping") or {}).values() if isinstance(v, dict))
    secs = (res.get("seconds") or {}).get("nonoverlapping")
    if scored and secs:
        extra["eval_tokens_per_s"] = scored / secs  # nonoverlapping scoring throughput over all L_ex
    return scalars, series, extra


def flatten_eval(res: dict) -> tuple[list, list]:
    """eval.evaluate() result -> (scalars [(protocol, L, metric, value)], series [(protocol, L, name, list)]).

    Per-length protocols give one row per numeric field (ppl, nll, tokens, ...); a length that could
    not run (e.g. learned APE beyond L_tr) stores no row and shows as "—" in the tables. The E6 verdict
    is stored as protocol "verdict:<p>" with metric extrapolates (0/1) and worst_ratio.
    """
    from ..eval.evaluate import BY_LENGTH

    scalars, series = [], []
    for proto in res.get("protocols", []):
        body = res.get(proto) or {}
        if proto in BY_LENGTH:
            for L, vals in body.items():
                for metric, v in (vals or {}).items():
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        scalars.append((proto, int(L), metric, float(v)))
        elif proto == "positionwise" and "nll" in body:
            for name in [n for n in ("nll", "ppl", "windowed_nll", "windowed_ppl") if n in body]:
                series.append((proto, int(body["length"]), name, [x if x is not None else float("nan") for x in body[name]]))
    for proto, v in (res.get("verdict") or {}).items():
        if isinstance(v, dict) and "extrapolates" in v:
            scalars.append((f"verdict:{proto}", 0, "extrapolates", float(bool(v["extrapolates"]))))
            if isinstance(v.get("worst_ratio"), (int, float)):
                scalars.append((f"verdict:{proto}", 0, "worst_ratio", float(v["worst_ratio"])))
    return scalars, series


def curve_series(run_dir: Path, summary: dict) -> list[tuple]:
    """A run's training curves (train/records.py ``curves``) as results.sqlite series rows
    ("train", 0, name, values), read back by report/curves.py."""
    from ..train.records import CURVES, curves, read_rows

    c = curves(read_rows(run_dir), summary.get("tokens_per_step"))
    return [("train", 0, name, c[name]) for name in CURVES if c[name]]
