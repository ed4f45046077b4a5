"""The resumable stages of a one-command study (`align experiment`, `align rope`, `extend`).

:class:`Stages` stores each computed stage as ``<out>/<name>.json`` keyed by the model and the
settings it used, and hands back the stored result when both match, so an interrupted study
resumes where it stopped. :func:`sayer` is the study's progress printer (stderr).
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from ..io import atomic_write_json


class Stages:
    """JSON results under ``out`` keyed by (model, settings): reused when the key matches."""

    def __init__(self, out: Path, model_key: dict, say, context=contextlib.nullcontext) -> None:
        self.out, self.model_key, self.say, self.seconds = out, model_key, say, {}
        self.context = context  # entered around every computed stage (the placement's autocast)

    def run(self, name: str, settings: dict, fn):
        path = self.out / f"{name}.json"
        key = json.loads(json.dumps({"model": self.model_key, "settings": settings}, default=str))
        if path.is_file():
            try:
                old = json.loads(path.read_text())
                if old.get("key") == key:
                    self.say(f"{name}: reusing {path.name}")
                    self.seconds[name] = old.get("seconds", 0.0)
                    return old["result"]
            except (ValueError, KeyError, AttributeError):
                pass  # damaged or foreign: recompute
        t = time.time()
        with self.context():
            result = fn()
        self.seconds[name] = time.time() - t
        atomic_write_json(path, {"key": key, "seconds": self.seconds[name], "result": result})
        return result


def sayer(progress: bool, verb: str = "align"):
    """A progress printer prefixed ``extrapolab <verb>`` on stderr, or a no-op."""
    if not progress:
        return lambda _m: None
    from rich.console import Console

    console = Console(stderr=True, soft_wrap=True)
    return lambda m: console.print(f"[bold cyan]extrapolab {verb}[/] {m}")
