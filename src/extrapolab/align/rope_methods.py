"""The RoPE context-extension methods as rotary schemes swapped onto a trained rotary run: one mapping
for `extrapolab align rope` (every method at s = L/L_tr) and `extrapolab eval RUN --rope TEXT` (the
``--rope`` text of hf/load.py, the same syntax as on ``hf:`` models).

Rotary has no parameters, so a method is applied at evaluation time by building its scheme and
putting it in place of the run's (:func:`swapped`): ``pi`` position interpolation (Chen et al.
2023, ``--rope linear:S``), ``ntk`` NTK-aware (bloc97 2023, ``ntk:S``), ``dynamic`` dynamic NTK
(``dynamic:A``, Hugging Face's factor), ``yarn`` YaRN (Peng et al. 2023, ``yarn:S``), the two-pass
methods of positional/rope_twopass.py (``selfextend:G[,w]``, ``rerope[:w]``, ``rerope-leaky[:w[,k]]``),
dual chunk attention (``dca[:C[,w]]``, An et al. 2024), StreamingLLM's pattern (``streaming[:K[,W]]``,
Xiao et al. 2024) and ``logn`` (q scaled by max(1, log(m+1)/log L_tr)); the kinds that are no `align
rope` method map to their own schemes with the same fields (``llama3`` -> ``rotary-llama3``,
``longrope`` -> ``rotary-longrope``, ``proportional`` -> ``rotary-proportional``; ``original=N`` is
the scheme's ``original_length``). A frequency rewrite joined with a multi-pass method is refused
(those schemes rotate with plain RoPE's frequencies).
"""
from __future__ import annotations

from contextlib import contextmanager

from .. import positional
from ..io import UserError
from ..positional.rope_twopass import default_settings

#: method -> (scheme, uses the factor s = L/L_tr, temperature rule or None)
METHODS = {
    "rope": ("rotary", False, None),
    "pi": ("rotary-pi", True, None),
    "ntk": ("rotary-ntk", True, None),
    "dynamic": ("rotary-dynamic", False, None),
    "yarn": ("rotary-yarn", True, None),
    "yarn-ramp": ("rotary-yarn", True, None),
    "pmax": ("rotary", False, "pmax"),
    "entropy": ("rotary", False, "entropy"),
    "length": ("rotary", False, "length"),
    "selfextend": ("rotary-selfextend", False, None),
    "rerope": ("rotary-rerope", False, None),
    "rerope-leaky": ("rotary-rerope-leaky", False, None),
    "dca": ("rotary-dca", False, None),
    "streaming": ("rotary-streaming", False, None),
    "logn": ("rotary", False, None),
}
#: ``--rope`` kind (hf/load.py) -> method
ROPE_KINDS = {"linear": "pi", "ntk": "ntk", "dynamic": "dynamic", "yarn": "yarn", "selfextend": "selfextend",
              "rerope": "rerope", "rerope-leaky": "rerope-leaky", "dca": "dca", "streaming": "streaming"}
#: ``--rope`` kinds that are no `align rope` method -> their rotary scheme (fields as its options)
KIND_SCHEMES = {"llama3": "rotary-llama3", "longrope": "rotary-longrope", "proportional": "rotary-proportional"}
_ORIG = "original_max_position_embeddings"  # transformers' name of the scheme's original_length
TWOPASS = ("selfextend", "rerope", "rerope-leaky")  # settings from default_settings in `align rope`
MULTIPASS = (*TWOPASS, "dca", "streaming")  # attention in several passes; dca / streaming: the schemes' defaults


def method_scheme(method: str, heads: int, train_length: int, *, factor: float | None = None,
                  settings: dict | None = None, logn: bool = False, **base):
    """The scheme of ``method``: ``factor`` for the methods that take one (PI, NTK, YaRN; dynamic's
    a), ``settings`` a two-pass method's (G, w, k), ``logn``, and ``base`` options of the run's own
    rotary (its ``base``)."""
    name = METHODS[method][0]
    params: dict = dict(base)
    if factor is not None:
        params["factor"] = float(factor)
    if name in ("rotary-dynamic", "rotary-yarn") or method in MULTIPASS or logn:
        params["original_length"] = int(train_length)
    if method == "yarn-ramp":
        params["attention_factor"] = 1.0
    if method in MULTIPASS:
        params.update(settings or {})
    if logn:
        params["logn"] = True
    return positional.build(name, heads, **params)


def method_setup(method: str, train_length: int, length: int, heads: int, taus: dict):
    """(scheme instance, softmax tau or None when the rule has no tau) for ``method`` at ``length``
    as `align rope` runs it: s = max(1, L/L_tr); Self-Extend and ReRoPE at their default settings;
    log-n on the ReRoPE patches."""
    _, scaled, rule = METHODS[method]
    scheme = method_scheme(
        method, heads, train_length, factor=max(1.0, length / train_length) if scaled else None,
        settings=default_settings(method, train_length, length) if method in TWOPASS else None,
        logn=method in ("rerope", "rerope-leaky", "logn"))  # the ReRoPE patches scale q by log-n
    tau = 1.0 if rule is None else taus.get(rule, {}).get(length)
    return scheme, tau


def rope_scheme(text: str, heads: int, train_length: int, base: dict | None = None):
    """``--rope`` text -> the rotary scheme for a run trained with plain ``rotary`` (options ``base``),
    or a one-line UserError (module doc)."""
    from ..hf.load import parse_rope

    spec = parse_rope(text)
    if spec.rewrite and spec.method:
        raise UserError(f"--rope on a rotary run takes a frequency rewrite or a two-pass method, not both "
                        f"(the two-pass schemes rotate with plain RoPE's frequencies); got {text!r}")
    kept = {k: v for k, v in (base or {}).items() if k == "base"}
    L_tr = int(train_length)
    if spec.logn:  # logn:L names the L_tr of the log-n factor
        L_tr = spec.logn
    logn = spec.logn is not None
    if spec.rewrite:
        kind, number = spec.rewrite
        fields = {("original_length" if k == _ORIG else k): v for k, v in spec.rewrite_params.items()}
        L0 = int(fields.pop("original_length", L_tr))
        if kind in ROPE_KINDS:
            return method_scheme(ROPE_KINDS[kind], heads, L0, factor=number, logn=logn, **kept, **fields)
        params = {**kept, **fields, "original_length": L0, **({"logn": True} if logn else {})}
        if kind == "proportional":
            params["p"] = number
        elif number is not None:
            params["factor"] = number
        if kind == "longrope" and "factor" not in params:
            raise UserError(f"--rope longrope on a run trained here needs its factor S (the length it extends to / "
                            f"L_tr): longrope:S,long=[...]; got {text!r}")
        return positional.build(KIND_SCHEMES[kind], heads, **params)
    if spec.method:
        settings = {k: (int(v) if k in ("G", "w", "chunk", "sinks") else float(v)) for k, v in spec.params.items()}
        return method_scheme(spec.method, heads, L_tr, settings=settings, logn=spec.logn is not None, **kept)
    return method_scheme("logn", heads, L_tr, logn=True, **kept)


@contextmanager
def swapped(model, scheme):
    """``model`` with ``scheme`` in place of its own (parameter-free rotary schemes only)."""
    old = model.scheme
    if any(True for _ in old.parameters()) or any(True for _ in scheme.parameters()):
        raise UserError("scheme swapping is for parameter-free schemes (rotary and its extensions)")
    model.scheme = scheme.to(next(model.parameters()).device)
    try:
        yield model
    finally:
        model.scheme = old
