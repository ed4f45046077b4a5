"""The brief's layout rule: stages import only earlier stages (no back-edges)."""
import ast
from pathlib import Path

import extrapolab

ROOT = Path(extrapolab.__file__).parent
#: stage order; top-level modules (config.py, io.py) are shared and may be imported by any stage
ORDER = ["positional", "model", "data", "train", "eval", "analysis", "regular", "report", "cli"]
#: what the shared top-level modules may import (config validates model/scheme options)
TOP_LEVEL = {"io": [], "config": ["positional", "model"]}


def _imported_stages(path: Path):
    rel = path.relative_to(ROOT).parts
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        mod = node.module or ""
        if node.level == 0:
            if not mod.startswith("extrapolab."):
                continue
            target = mod.split(".")[1:]
        else:
            target = list(rel[: len(rel) - node.level]) + (mod.split(".") if mod else [node.names[0].name])
        if target:
            yield node.lineno, target[0]


def test_no_stage_imports_a_later_stage():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        for line, tgt in _imported_stages(path):
            if tgt not in ORDER:
                continue
            if len(rel) == 1:
                allowed = TOP_LEVEL.get(path.stem, [])
                ok = tgt in allowed
            else:
                ok = rel[0] not in ORDER or ORDER.index(tgt) <= ORDER.index(rel[0])
            if not ok:
                bad.append(f"{'/'.join(rel)}:{line} imports {tgt}")
    assert not bad, bad
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages - {"presets"} == set(ORDER)  # presets/ holds YAML only
