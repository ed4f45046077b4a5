"""The `extrapolab schemes` listing: every registered scheme, its options and paper reference."""
from __future__ import annotations

from ..positional import REGISTRY, build, scheme_params


def scheme_rows(num_heads: int = 8) -> list[dict]:
    rows = []
    for name in sorted(REGISTRY):
        cls = REGISTRY[name]
        try:
            inst = build(name, num_heads=num_heads)
            learnable = sum(p.numel() for p in inst.parameters() if p.requires_grad)
        except Exception as e:  # a scheme that cannot build with defaults says why
            learnable = f"n/a ({e})"
        rows.append({
            "name": name,
            "kind": cls.kind,
            "summary": cls.summary,
            "options": scheme_params(cls),
            "params@H=8": learnable,
            "paper": cls.paper,
        })
    return rows


def print_scheme_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{len(rows)} positional schemes (build with --set model.scheme=NAME, options via model.scheme_params.KEY=V)")
    for col in ("name", "kind", "params@H=8", "options", "paper"):
        t.add_column(col, overflow="fold")
    for r in rows:
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items()) or "-"
        t.add_row(r["name"], r["kind"], str(r["params@H=8"]), opts, r["paper"])
    Console(width=200).print(t)
    from ..model.attn_extras import OPTIONS

    o = Table(title=f"{len(OPTIONS)} attention options any scheme combines with (--set model.NAME=true)")
    for col in ("name", "what", "paper"):
        o.add_column(col, overflow="fold")
    for name, (what, paper) in OPTIONS.items():
        o.add_row(name, what, paper)
    Console(width=200).print(o)
