"""user-defined relative schemes from a Python callable (docs/architecture.md, "Positional schemes").

``form="bias"``: ``fn(k)`` is the additive bias on the scaled logits for distances k = m - n >= 0.
``form="b"``:    ``fn(k)`` is b(k) > 0 and the bias is log b(k) (Qin et al. 2024, eq. 7:
                 exp(q·k/sqrt(d))·b(k); Theorem 0.4 asks whether sum_k b(k) converges).
``per_head=True``: the callable is ``fn(k, h)`` for head h = 0..H-1.

``k`` is passed as a float64 torch tensor (numpy array if the torch call fails) and the result is
broadcast to k's shape. The class exposes ``bias_fn(k, h=0)`` and ``b(k, h=0)`` (float64) so the
theory tools (A2) treat it like the built-in schemes. Checked once, with one-line errors: b(k) > 0
and finite on k = 0..1023 (form b); bias(0) finite and no NaN/+inf (form bias).

Spec strings (for the CLI and configs): ``build("bias:package.module:function", H)`` or
``build("b:/path/to/file.py:function", H)`` imports the function and registers it under that
string on the fly; a function with two required positional parameters is taken as ``fn(k, h)``.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
from typing import Callable

import numpy as np
import torch

from .base import RelativeBias, SchemeError

FORMS = ("bias", "b")
CHECK_DISTANCES = 1024


def _call(fn: Callable, name: str, k: torch.Tensor, h: int | None) -> torch.Tensor:
    """fn(k[, h]) as float64 tensor shaped like k (k is float64 on the CPU)."""
    args = (k,) if h is None else (k, h)
    try:
        out = fn(*args)
    except Exception as e_torch:  # noqa: BLE001 - user code; retry with numpy
        try:
            out = fn(*((k.numpy(),) + args[1:]))
        except Exception:  # noqa: BLE001
            msg = str(e_torch).splitlines()[0] if str(e_torch) else ""
            raise SchemeError(
                f"scheme {name!r}: calling its function on a float64 tensor of distances failed "
                f"({type(e_torch).__name__}: {msg}); use element-wise torch or numpy operations"
            ) from None
    try:
        out = torch.as_tensor(np.asarray(out) if not torch.is_tensor(out) else out).to(torch.float64)
        return torch.broadcast_to(out, k.shape)
    except (TypeError, ValueError, RuntimeError):
        raise SchemeError(
            f"scheme {name!r}: its function must return one number per distance (shape {tuple(k.shape)})"
        ) from None


def _validate(cls, h: int) -> None:
    k = torch.arange(CHECK_DISTANCES, dtype=torch.float64)  # [1024]
    head = f" (head {h})" if cls.per_head else ""
    if cls.form == "b":
        b = cls.b(k, h)
        bad = ~(torch.isfinite(b) & (b > 0))
        if bool(bad.any()):
            k0 = int(torch.nonzero(bad)[0])
            raise SchemeError(
                f"scheme {cls.name!r}: b(k) must be finite and > 0 for k = 0..{CHECK_DISTANCES - 1}, "
                f"got b({k0}) = {float(b[k0])}{head}; use form='bias' for -inf masks"
            )
    bias = cls.bias_fn(k, h)
    if not math.isfinite(float(bias[0])):
        raise SchemeError(f"scheme {cls.name!r}: bias(0) must be finite, got {float(bias[0])}{head}")
    if bool(torch.isnan(bias).any()) or bool((bias == math.inf).any()):
        raise SchemeError(f"scheme {cls.name!r}: bias(k) is NaN or +inf for some k < {CHECK_DISTANCES}{head}")


def make_callable_scheme(
    name: str, fn: Callable, form: str = "bias", per_head: bool = False, summary: str = ""
) -> type[RelativeBias]:
    """A RelativeBias subclass (not yet registered) whose bias comes from ``fn``."""
    if not isinstance(name, str) or not name.strip():
        raise SchemeError(f"a user scheme needs a non-empty name, got {name!r}")
    if not callable(fn):
        raise SchemeError(f"scheme {name!r}: fn must be callable, got {type(fn).__name__}")
    if form not in FORMS:
        raise SchemeError(f"scheme {name!r}: form must be 'bias' or 'b', got {form!r}")
    what = getattr(fn, "__qualname__", type(fn).__name__)
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    eq = "bias = log b(k), Qin et al. 2024 eq. 7" if form == "b" else "additive bias(k)"

    class UserScheme(RelativeBias):
        def __init__(self, num_heads: int) -> None:
            super().__init__(num_heads)
            if type(self).per_head:
                for h in range(1, self.num_heads):  # head 0 was checked at creation
                    _validate(type(self), h)

        @classmethod
        def bias_fn(cls, k, h: int = 0) -> torch.Tensor:
            """Additive bias for distances k (float64, shape of k)."""
            if cls.form == "b":
                return torch.log(cls.b(k, h))
            return _call(cls._fn, cls.name, torch.as_tensor(k, dtype=torch.float64).cpu(),
                         h if cls.per_head else None)

        @classmethod
        def b(cls, k, h: int = 0) -> torch.Tensor:
            """b(k) = exp(bias(k)) (float64, shape of k)."""
            if cls.form == "b":
                return _call(cls._fn, cls.name, torch.as_tensor(k, dtype=torch.float64).cpu(),
                             h if cls.per_head else None)
            return torch.exp(cls.bias_fn(k, h))

        def bias_from_distance(self, dist, layer=0):
            k = dist.to(torch.float64).cpu()
            if self.per_head:
                out = torch.stack([self.bias_fn(k, h) for h in range(self.num_heads)])  # [H, ...]
            else:
                out = self.bias_fn(k).unsqueeze(0).expand(self.num_heads, *dist.shape)  # [H, ...]
            return out.to(dist.device)

    UserScheme.__name__ = UserScheme.__qualname__ = f"UserScheme[{name}]"
    UserScheme.name = name
    UserScheme.paper = f"user-defined relative scheme from {what} ({eq})"
    UserScheme.summary = summary or (doc[0] if doc else f"user-defined {form}(k) from {what}")
    UserScheme.form = form
    UserScheme.per_head = bool(per_head)
    UserScheme._fn = staticmethod(fn)
    _validate(UserScheme, 0)
    return UserScheme


# ---- spec strings: "bias:package.module:function", "b:/path/to/file.py:function" ---------------
def is_callable_spec(name: str) -> bool:
    return isinstance(name, str) and name.count(":") >= 2 and name.split(":", 1)[0] in FORMS


def _import_target(spec: str, target: str):
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise SchemeError(f"scheme {spec!r}: no such file {path}; give an existing .py file")
        modname = "extrapolab_user_" + hashlib.sha256(path.encode()).hexdigest()[:12]
        loader_spec = importlib.util.spec_from_file_location(modname, path)
        if loader_spec is None or loader_spec.loader is None:
            raise SchemeError(f"scheme {spec!r}: cannot load {path} as Python; give a .py file")
        module = importlib.util.module_from_spec(loader_spec)
        runner = functools.partial(loader_spec.loader.exec_module, module)
    else:
        module, runner = None, functools.partial(importlib.import_module, target)
    try:
        loaded = runner()
    except ModuleNotFoundError as e:
        raise SchemeError(
            f"scheme {spec!r}: cannot import module {target!r} ({e}); check the name or PYTHONPATH"
        ) from None
    except Exception as e:  # noqa: BLE001 - user code failed while importing
        first = str(e).splitlines()[0] if str(e) else ""
        raise SchemeError(f"scheme {spec!r}: importing {target!r} failed ({type(e).__name__}: {first})") from None
    return module if module is not None else loaded


def load_spec(spec: str) -> type[RelativeBias]:
    """Import the callable named by ``spec`` and build its scheme class (the registry registers it)."""
    form, rest = spec.split(":", 1)
    target, _, func = rest.rpartition(":")
    if not target or not func:
        raise SchemeError(f"scheme {spec!r}: write {form}:package.module:function or {form}:file.py:function")
    module = _import_target(spec, target)
    try:
        fn = functools.reduce(getattr, func.split("."), module)
    except AttributeError:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise SchemeError(
            f"scheme {spec!r}: {target!r} has no function {func!r}; available: {', '.join(public[:12]) or 'none'}"
        ) from None
    if not callable(fn):
        raise SchemeError(f"scheme {spec!r}: {target}:{func} is a {type(fn).__name__}, not a function")
    try:
        params = inspect.signature(fn).parameters.values()
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                      and p.default is p.empty]
        per_head = len(positional) >= 2
    except (TypeError, ValueError):
        per_head = False
    return make_callable_scheme(spec, fn, form=form, per_head=per_head,
                                summary=f"user {form}(k) from {target}:{func}")
