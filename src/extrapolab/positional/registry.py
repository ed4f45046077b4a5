"""Scheme registry: adding a scheme = one file + one line in ``positional/__init__.py``."""
from __future__ import annotations

import difflib
import inspect
from typing import Callable

from .base import PositionalScheme, SchemeError
from .custom import is_callable_spec, load_spec, make_callable_scheme

REGISTRY: dict[str, type[PositionalScheme]] = {}


def register(cls: type[PositionalScheme]) -> type[PositionalScheme]:
    """Class decorator: make ``cls`` buildable by its ``name``."""
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise SchemeError(f"scheme name {cls.name!r} is already registered; choose another name")
    REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(REGISTRY)


def _suggest(name: str, pool: list[str]) -> str:
    close = difflib.get_close_matches(name, pool, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}? " if close else ""


def scheme_params(cls: type[PositionalScheme]) -> dict[str, object]:
    """Keyword parameters of a scheme's constructor with their defaults."""
    out: dict[str, object] = dict(getattr(cls, "EXTRA_OPTIONS", None) or {})  # options taken via **kwargs
    for klass in cls.__mro__:
        if klass is PositionalScheme or "__init__" not in vars(klass):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.name in ("self", "num_heads") or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            out.setdefault(p.name, None if p.default is p.empty else p.default)
        break
    return out


def build(name: str, num_heads: int, **params) -> PositionalScheme:
    """Build scheme ``name`` for ``num_heads`` heads; unknown names/options fail in one line.

    ``name`` may also be a user-callable spec, ``bias:package.module:function`` or
    ``b:/path/to/file.py:function`` (user-defined scheme): it is imported and registered on the fly.
    """
    cls = REGISTRY.get(name)
    if cls is None and ":" in str(name) and is_callable_spec(name):
        cls = register(load_spec(name))
    if cls is None:
        hint = " (user callables: bias:module:function or b:file.py:function)" if ":" in str(name) else ""
        raise SchemeError(
            f"unknown positional scheme {name!r}; {_suggest(name, names())}"
            f"run `extrapolab schemes` to list the {len(REGISTRY)} valid names{hint}"
        )
    allowed = scheme_params(cls)
    for key in params:
        if key not in allowed:
            valid = ", ".join(sorted(allowed)) or "none"
            raise SchemeError(
                f"scheme {name!r} has no option {key!r}; {_suggest(key, list(allowed))}"
                f"valid options: {valid}"
            )
    return cls(num_heads=num_heads, **params)


def register_callable(
    name: str,
    fn: Callable,
    *,
    form: str = "bias",
    per_head: bool = False,
    summary: str = "",
    overwrite: bool = False,
) -> type[PositionalScheme]:
    """Register a user-defined relative scheme from a Python callable.

    ``form="bias"``: ``fn(k)`` returns the additive bias for distance tensor ``k`` (float64);
    ``form="b"``: ``fn(k)`` returns b(k) > 0 and the bias is log b(k) (Qin et al. 2024, eq. 1).
    With ``per_head=True`` the callable is ``fn(k, h)`` for head index h = 0..H-1.
    """
    if name in REGISTRY and not overwrite:
        raise SchemeError(f"scheme name {name!r} is already registered; pass overwrite=True")
    REGISTRY.pop(name, None)
    return register(make_callable_scheme(name, fn, form=form, per_head=per_head, summary=summary))
