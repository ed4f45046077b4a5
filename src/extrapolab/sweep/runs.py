"""`extrapolab eval RUN`: evaluate one trained run with the protocols E1-E6 and write eval.json."""
from __future__ import annotations

from pathlib import Path

from .. import config as C
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


def eval_run(run: str | Path, *, protocols=None, lengths=None, temperature: str = "1.0",
             overrides=None, which: str = "best", device: str = "auto", dtype: str = "auto") -> dict:
    """Evaluate ``run`` on ``device`` under ``dtype`` autocast (train.placement rules; recorded in eval.json)."""
    from ..data import prepare
    from ..eval import evaluate_config
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
    place = placement(device, dtype)
    model, _ = load_model(run, which=which, device=place.device)
    model.eval()
    data = prepare(cfg.data, progress=False)
    tokens = data.split(ecfg.split)
    tau = _temperature(temperature, run, ecfg.lengths)
    if isinstance(tau, dict):  # per-length temperature chosen by `extrapolab align`
        results = {}
        for L, t in tau.items():
            ecfg.temperature = t
            with place.autocast():
                results[L] = evaluate_config(model, tokens, _only(ecfg, L), cfg.model.train_length)
        res = {"per_length_temperature": {str(k): v for k, v in tau.items()}, "runs": results}
        md = "\n".join(f"L={L} τ={tau[L]}: " + _ppl_line(r) for L, r in results.items())
    else:
        ecfg.temperature = tau
        with place.autocast():
            res = evaluate_config(model, tokens, ecfg, cfg.model.train_length)
        md = markdown_summary(res)
    res["placement"] = place.describe()
    name = "eval.json" if temperature in ("1", "1.0") else f"eval-temperature-{temperature}.json"
    atomic_write_json(run / name, res)
    return {"result": res, "markdown": md, "path": run / name}


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
