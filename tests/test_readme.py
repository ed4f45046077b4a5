"""The README's commands exist as written: every `extrapolab` command in its code blocks names a real
verb (and sub-verb) with options that verb accepts and presets that exist; every `make` target is in
the Makefile; every relative link and the picture are files of the repository. `.ci/run` runs
`make test`, the README's test command."""
import re
import shlex
from pathlib import Path

import typer

from extrapolab.cli.main import app
from extrapolab.config import preset_names

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
def _commands() -> list[list[str]]:
    """Each command line of the README's ```bash blocks, continuations joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(words)
    return out


def _extrapolab_calls() -> list[list[str]]:
    calls = []
    for words in _commands():
        for i, w in enumerate(words):
            if w == "extrapolab" or w.endswith("/extrapolab") or words[i - 1:i + 1] == ["-m", "extrapolab"]:
                calls.append(words[i + 1:])
                break
    return calls


def test_readme_names_the_two_commands_and_ci_runs_make_test():
    assert len(README.splitlines()) <= 250  # read in five minutes; detail lives in docs/
    first = README.split("\n## ", 1)[0]  # the first screen: before the first section
    assert "make demo" in first and "make test" in first
    assert "![" in first  # its one picture
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("make test")


def test_every_make_target_exists():
    targets = set(re.findall(r"^([A-Za-z0-9_.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    used = {w[1] for w in _commands() if w[0] == "make" and len(w) > 1}
    used |= set(re.findall(r"`make ([a-z0-9-]+)", README))
    assert {"demo", "test", "model-smollm2"} <= used
    assert used <= targets, f"README names make targets the Makefile lacks: {sorted(used - targets)}"


def test_every_extrapolab_command_parses():
    root = typer.main.get_command(app)
    calls = _extrapolab_calls()
    assert {c[0] for c in calls} >= {"train", "eval", "sweep", "report", "extend", "demo"}
    presets = set(preset_names())
    for call in calls:
        cmd, rest = root, list(call)
        while hasattr(cmd, "commands") and rest and rest[0] in cmd.commands:
            cmd = cmd.commands[rest.pop(0)]
        assert cmd is not root, f"`extrapolab {' '.join(call)}`: no such verb"
        options = {o for p in cmd.params for o in p.opts + p.secondary_opts}
        for w in rest:
            if w.startswith("-"):
                assert w.split("=")[0] in options, f"`extrapolab {' '.join(call)}`: {w} is not an option"
        if "--preset" in rest:
            name = rest[rest.index("--preset") + 1]
            assert name in presets or f"demo-{name}" in presets, f"unknown preset {name}"
        if call[0] == "sweep":
            assert rest[0] in presets, f"unknown sweep config {rest[0]}"


def test_the_verb_table_lists_every_verb():
    table = dict(re.findall(r"^\| `([a-z-]+)` \| (.+) \|$", README, flags=re.M))
    verbs = set(typer.main.get_command(app).commands)
    assert set(table) == verbs


def test_links_and_picture_are_files():
    links = [t for t in re.findall(r"\]\(([^)#]+)\)", README) if "://" not in t]
    assert links
    missing = {t for t in links if not (ROOT / t).is_file()}
    assert not missing, f"broken links: {sorted(missing)}"
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README)
    assert len(pictures) == 1
    assert (ROOT / pictures[0]).stat().st_size < 200_000

