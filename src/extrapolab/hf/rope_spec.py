"""``--rope`` on ``hf:`` models: the text parsed (:func:`parse_rope`), the config's RoPE read and checked
(:func:`uses_rope`, :func:`check_rope_parameters`) and its ``rope_parameters`` rewritten (:func:`apply_rope`)
before the model is built; hf/load.py's module doc lists the kinds and methods.

RoPE-ness comes from the config, not from a list of families: a model uses RoPE when its config has
``rope_parameters`` (transformers 5: one dict, or one per layer type, ``None`` for a NoPE type), as Llama,
Qwen2, Gemma 2 / 3, Cohere2, Llama 4, SmolLM3 and gpt-oss do; hf/load.py also checks that transformers
built a rotary embedding from them. Which layers rotate is the model's own business (Llama 4's and
SmolLM3's ``no_rope_layers``, Cohere2's full layers): a rewrite changes the rotary embedding, which a NoPE
layer never reads, so it stays NoPE (hf/geometry.py measures which layers rotate where a method needs it).

Parameters that already scale RoPE (``rope_type`` other than ``default``: Gemma 3 4B's full layers ship
linear x8, gpt-oss YaRN x32): a rewrite would replace them, and a scaling over a scaled base (YaRN over
linear) has no published definition, so it is refused in one line naming both, unless the rewrite says
``replace=true``. Then the new kind starts from the type's unscaled RoPE (its ``rope_theta``), and YaRN /
llama3 / LongRoPE scale from ``original=N``, else the old parameters' ``original_max_position_embeddings``,
else ``--train-length``; with none of them it is a one-line error (max_position_embeddings is the scaled
length there, not the one the unscaled RoPE was trained at). The run record keeps the parameters before
and after (``model.rope_parameters_before``, ``model.rope_parameters``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..io import UserError
from . import extend, layer_types, rope_kinds

ROPE_KINDS = rope_kinds.KINDS
ROPE_SYNTAX = (f"{rope_kinds.SYNTAX}, selfextend:G[,w], rerope[:w], rerope-leaky[:w[,k]], dca[:C[,w]], "
               "streaming[:K[,W]], logn[:L_tr], joined by +; KIND:ARGS@TYPE rewrites one layer type's")
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "seq_length")
_ORIG = "original_max_position_embeddings"
_SCALED = ("linear", "dynamic", "yarn", "longrope", "llama3")  # transformers: their factor must be >= 1


def config_train_length(config) -> int | None:
    for key in _LENGTH_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def uses_rope(config) -> bool:
    """Whether the config describes RoPE: ``rope_parameters`` one dict, or per layer type with one that is a dict."""
    rp = getattr(config, "rope_parameters", None)
    if not isinstance(rp, dict) or not rp:
        return False
    nested = layer_types.nested_types(config)
    return any(isinstance(rp[k], dict) for k in nested) if nested else True


def _number(p: dict, key: str, low: float, label: str, where: str, fix: str) -> None:
    v = p.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not v >= low:
        bound = f">= {low:g}" if low > 0 else "> 0"
        raise UserError(f"{where}: {label}[{key!r}] is {v!r}; it must be a number {bound} ({fix})")


def check_rope_parameters(config, where: str) -> None:
    """A one-line UserError for ``rope_parameters`` transformers would crash on or only warn about: not a
    mapping, an unknown ``rope_type``, a ``rope_theta`` / factor that is not a positive number (a factor
    below 1), an ``original_max_position_embeddings`` that is not a whole number >= 1."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = getattr(config, "rope_parameters", None)
    if rp is None:
        return
    fix = "fix rope_parameters in config.json, e.g. {\"rope_type\": \"default\", \"rope_theta\": 10000.0}"
    if not isinstance(rp, dict):
        raise UserError(f"{where}: rope_parameters is {rp!r}, not a mapping; {fix}")
    nested = layer_types.nested_types(config)
    for key, p in ({k: rp[k] for k in nested} if nested else {"": rp}).items():
        label = f"rope_parameters[{key!r}]" if key else "rope_parameters"
        if p is None and key:
            continue  # a NoPE layer type
        if not isinstance(p, dict):
            raise UserError(f"{where}: {label} is {p!r}, not a mapping (or null for a NoPE layer type); {fix}")
        kind = p.get("rope_type", p.get("type", "default"))
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            raise UserError(f"{where}: {label} has rope_type {kind!r}, which transformers does not know; use one "
                            f"of default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
        _number(p, "rope_theta", 0.0, label, where, "the RoPE base, e.g. 10000.0")
        _number(p, "factor", 1.0 if kind in _SCALED else 0.0, label, where, "the extension factor s")
        _number(p, "attention_factor", 0.0, label, where, "the scale of cos and sin")
        _number(p, "partial_rotary_factor", 0.0, label, where, "the fraction of each head that rotates")
        o = p.get(_ORIG)
        if o is not None and (isinstance(o, bool) or not isinstance(o, int) or o < 1):
            raise UserError(f"{where}: {label}[{_ORIG!r}] is {o!r}; it must be a whole number of tokens >= 1")


@dataclass(frozen=True)
class RopeSpec:
    """A parsed ``--rope``: a rope_parameters rewrite, a two-pass method, log-n (each optional)."""

    text: str
    rewrite: tuple[str, float | None] | None = None  # (kind, factor; proportional: the fraction p)
    rewrite_params: dict = field(default_factory=dict)  # its key=value fields, as rope_parameters keys
    layer_type: str | None = None  # KIND:ARGS@TYPE: the rewrite of that layer type's rope_parameters only
    replace: bool = False  # KIND:ARGS,replace=true: replace parameters that already scale RoPE (module doc)
    method: str | None = None  # selfextend | rerope | rerope-leaky | dca | streaming
    params: dict = field(default_factory=dict)  # G, w, k, chunk as given (an absent one: the default)
    logn: int | None = None  # None off, 0 = the model's L_tr, else the L_tr to use

    @property
    def extends(self) -> bool:
        """Whether the model needs the extrapolab attention function."""
        return self.method is not None or self.logn is not None


def _numbers(kind: str, args: str, n: int, text: str) -> list[float]:
    vals = [a for a in args.split(",") if a] if args else []
    try:
        nums = [float(a) for a in vals]
    except ValueError:
        nums = []
    if len(vals) > n or len(nums) != len(vals) or not all(math.isfinite(x) for x in nums):
        raise UserError(f"--rope {kind} takes at most {n} number(s) ({ROPE_SYNTAX}); got {text!r}")
    return nums


def parse_rope(spec: str) -> RopeSpec:
    """``--rope`` text -> :class:`RopeSpec`, or a one-line UserError with the syntax."""
    text = str(spec).strip()
    out: dict = {"rewrite": None, "rewrite_params": {}, "method": None, "params": {}, "logn": None, "layer_type": None,
                 "replace": False}
    for part in rope_kinds.split_top(text, "+"):
        part, *at = rope_kinds.split_top(part.strip(), "@")
        kind, _, args = part.strip().partition(":")
        if at and (kind not in ROPE_KINDS or len(at) > 1 or not at[0].strip()):
            raise UserError(f"--rope KIND:ARGS@TYPE names one layer type after a rope_parameters rewrite, e.g. "
                            f"yarn:4@full; got {text!r}")
        if kind in ROPE_KINDS:
            if out["rewrite"]:
                raise UserError(f"--rope takes one KIND:FACTOR with FACTOR >= 1, e.g. --rope yarn:4; got {text!r}")
            out["layer_type"] = at[0].strip() if at else None
            factor, fields = rope_kinds.parse_rewrite(kind, args, text)
            out["replace"] = bool(fields.pop(rope_kinds.REPLACE, False))
            if kind not in ("longrope", "proportional"):  # the others need FACTOR >= 1 (checked again on apply)
                rope_kinds.check_factor(kind, factor, text, "yarn:4")
            out["rewrite"], out["rewrite_params"] = (kind, factor), fields
        elif kind in extend.TWOPASS:
            if out["method"]:
                raise UserError(f"--rope takes one two-pass, dca or streaming method (they run several passes); "
                                f"got {text!r}")
            nums = _numbers(kind, args, 2 if kind != "rerope" else 1, text)
            names = {"selfextend": ("G", "w"), "dca": ("chunk", "w"), "streaming": ("sinks", "w")}.get(kind,
                                                                                                  ("w", "k"))
            if kind == "selfextend" and not nums:
                raise UserError(f"--rope selfextend needs the group size: selfextend:G[,w], e.g. selfextend:4,1024; "
                                f"got {text!r}")
            params = dict(zip(names, nums))
            if any(float(params[p]) != int(params[p]) for p in ("G", "w", "chunk", "sinks") if p in params):
                raise UserError(f"--rope {kind}: G, C, K and w are whole numbers of tokens; got {text!r}")
            out["method"], out["params"] = kind, params
        elif kind == "logn" and out["logn"] is None:
            L = _numbers(kind, args, 1, text)
            if L and not (L[0] >= 2 and L[0] == int(L[0])):
                raise UserError(f"--rope logn:L takes the training length L >= 2; got {text!r}")
            out["logn"] = int(L[0]) if L else 0
        else:
            raise UserError(f"--rope takes {ROPE_SYNTAX}; got {text!r}")
    if out["method"] and out["rewrite"] and out["rewrite"][0] in ("dynamic", "longrope"):
        raise UserError(f"--rope {out['rewrite'][0]} changes the frequencies with the length; a multi-pass method "
                        f"needs fixed ones: drop one of them (got {text!r})")
    return RopeSpec(text, **out)


def _describe(p: dict) -> str:
    """``linear, factor 8`` / ``yarn, factor 32, original 4096``: what a scaled type's parameters are."""
    bits = [str(p.get("rope_type", "default"))]
    if p.get("factor") is not None:
        bits.append(f"factor {p['factor']:g}")
    if p.get(_ORIG) is not None:
        bits.append(f"original {p[_ORIG]}")
    return ", ".join(bits)


def _with_replace(spec: RopeSpec) -> str:
    """The spec's text with ``,replace=true`` in its rewrite (before any ``@TYPE``)."""
    parts = rope_kinds.split_top(spec.text, "+")
    for i, part in enumerate(parts):
        head, *at = rope_kinds.split_top(part.strip(), "@")
        if head.partition(":")[0].strip() == spec.rewrite[0]:
            parts[i] = head + (",replace=true" if ":" in head else ":replace=true") + "".join("@" + a for a in at)
    return "+".join(parts)


def _original(spec: RopeSpec, old: dict, original: int | None, label: str, config) -> int | None:
    """The L_tr YaRN / llama3 / LongRoPE scale from (module doc); None where the kind reads none."""
    if spec.rewrite[0] not in ("yarn", "llama3", "longrope") or spec.rewrite_params.get(_ORIG):
        return int(original) if original else config_train_length(config)
    if old.get("rope_type", "default") == "default":
        return int(original) if original else config_train_length(config)
    if old.get(_ORIG):
        return int(old[_ORIG])
    if original:
        return int(original)
    raise UserError(f"--rope {spec.text}: replacing {label} ({_describe(old)}) needs the length its unscaled RoPE was "
                    f"trained at, which the config does not give (max_position_embeddings is the scaled one); give "
                    f"it: {spec.rewrite[0]}:...,original=N")


def apply_rope(config, spec: str | RopeSpec, original: int | None = None) -> dict | None:
    """Rewrite ``config.rope_parameters`` for the spec's rewrite part (module doc); returns the new
    parameters (None when the spec has no rewrite, only checks that the model uses RoPE).
    ``original``: the pre-training length YaRN / llama3 scale from (default: the config's)."""
    spec = spec if isinstance(spec, RopeSpec) else parse_rope(spec)
    rp = getattr(config, "rope_parameters", None)
    if not uses_rope(config):
        how = "its RoPE table comes from rotary_dim, which neither a rewrite nor the registered attention reaches" \
            if getattr(config, "rotary_dim", None) else "it encodes positions otherwise"
        raise UserError(f"--rope applies to RoPE models built from rope_parameters, but this {config.model_type} model "
                        f"has no rope_parameters ({how}); drop --rope")
    if spec.rewrite is None:
        return None
    kind, number = spec.rewrite
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    nested = layer_types.nested_types(config)
    if nested or spec.layer_type:  # per layer type (hf/layer_types.py): that type's, or every RoPE type's
        which = [layer_types.resolve(config, spec.layer_type, spec.text)] if spec.layer_type else \
            [k for k in nested if rp[k] is not None]
        targets = {k: (rp[k], f"layer type {k}'s rope_parameters") for k in which}
    else:
        targets = {None: (rp, f"this {config.model_type} model's rope_parameters")}
    new = dict(rp)
    for key, (old, label) in targets.items():
        if old is None:
            raise UserError(f"--rope {spec.text}: layer type {key} has no RoPE (a NoPE layer); drop @TYPE or name "
                            f"a RoPE type: {', '.join(layer_types.short(k) for k in nested if rp[k] is not None)}")
        was = old.get("rope_type", "default")
        if was != "default" and not spec.replace:
            raise UserError(f"--rope {spec.text}: {label} already scale RoPE ({_describe(old)}), and {kind} over "
                            f"{was} has no published definition; to replace them write --rope {_with_replace(spec)} "
                            f"({kind} from the unscaled RoPE), or drop the rewrite")
        orig = _original(spec, old, original, label, config)
        out = rope_kinds.rope_parameters(kind, number, spec.rewrite_params, old, head_dim, orig, spec.text)
        if key is None:
            new = out
            continue
        new[key] = out
        if "truncate" in out:  # transformers' YaRN reads it at the top level only (layer_types module doc)
            new["truncate"] = out["truncate"]
    config.rope_parameters = new
    try:
        if hasattr(config, "validate_rope"):
            config.validate_rope()
    except (ValueError, KeyError) as e:
        raise UserError(f"transformers rejects --rope {spec.text}: {str(e).splitlines()[0]}") from None
    return new
