"""The layout rules of docs/architecture.md: stages import only earlier stages (no back-edges),
studies sit beside the stages, and no module imports another that (directly or not) imports it
back -- imports inside functions included."""
import ast
from pathlib import Path

import extrapolab

ROOT = Path(extrapolab.__file__).parent
#: stages in pipeline order, the executor of many runs, then the studies built on them, then the CLI;
#: each may import only itself and what comes before it
STAGES = ["positional", "model", "data", "train", "eval", "analysis", "report"]
STUDIES = ["perf", "hf", "tasks", "align", "extend", "regular", "sweep"]
ORDER = STAGES + ["executor"] + STUDIES + ["cli"]
#: what the shared top-level modules may import (config validates model/scheme options)
TOP_LEVEL = {"io": [], "memory": [], "config": ["positional", "model"], "__main__": ["cli"]}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """dotted name relative to the package ('' for extrapolab itself) -> file."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """(line, imported module) for every extrapolab import in the file, at any depth."""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    pkg = [p for p in pkg if p]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("extrapolab."):
                    yield node.lineno, a.name.split(".", 1)[1]
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if not (node.module or "").startswith("extrapolab"):
                continue
            base = (node.module or "").split(".")[1:]
        else:
            base = pkg[: len(pkg) - (node.level - 1)] + ((node.module or "").split(".") if node.module else [])
        for a in node.names:  # `from .pkg import submodule` imports that submodule
            sub = ".".join(base + [a.name])
            yield node.lineno, sub if sub in modules else ".".join(base)


def test_no_stage_imports_a_later_stage():
    modules, bad = _modules(), []
    for name, path in modules.items():
        rel = path.relative_to(ROOT).parts
        for line, tgt in _imports(name, path, modules):
            top = tgt.split(".")[0]
            if top not in ORDER:
                continue
            if len(rel) == 1:
                ok = top in TOP_LEVEL.get(path.stem, [])
            else:
                ok = rel[0] not in ORDER or ORDER.index(top) <= ORDER.index(rel[0])
            if not ok:
                bad.append(f"{'/'.join(rel)}:{line} imports {tgt}")
    assert not bad, bad
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages - {"presets"} == set(ORDER)  # presets/ holds YAML only


def _cycles(root: Path = ROOT) -> list[str]:
    modules = _modules(root)
    graph = {n: {t for _, t in _imports(n, p, modules) if t in modules and t != n} for n, p in modules.items()}
    # a package's __init__ importing its own submodules is how packages are built, not a cycle;
    # a submodule importing its package's __init__ back is one
    state, stack, cycles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for t in sorted(graph[n]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return [" -> ".join(c) for c in cycles]


def test_no_import_cycles_even_inside_functions():
    assert not _cycles()


def test_the_checker_sees_a_cycle_hidden_in_a_function(tmp_path):
    """The cycle test must be able to fail: a.py imports b at the top, b imports a in a function."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from .b import g\n")
    (tmp_path / "pkg" / "b.py").write_text("def g():\n    from .a import x\n    return x\n")
    (tmp_path / "pkg" / "c.py").write_text("from . import a\n")
    assert _cycles(tmp_path / "pkg") == ["a -> b -> a"]
