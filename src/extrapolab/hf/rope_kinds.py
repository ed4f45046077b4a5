"""The ``rope_parameters`` rewrites of ``--rope KIND:ARGS`` on ``hf:`` models (hf/load.py), checked here.

Each kind is a Hugging Face rope type (``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``) except
``ntk`` (static NTK-aware, a new ``rope_theta`` of default RoPE); the model is then built by
transformers with those parameters, so its own implementation runs. ARGS are comma-separated: an
optional positional number and ``key=value`` pairs; a list is written in brackets, numbers joined by
commas (quote the whole argument in a shell):

    linear:S  dynamic:S  ntk:S
    yarn:S[,original=N,beta_fast=B,beta_slow=B,attention_factor=F,mscale=A,mscale_all_dim=A,truncate=false]
    llama3:S[,low=1,high=4,original=N]                (Llama 3.1: llama3:8; original = L_tr by default)
    longrope:[S,]long=[...][,short=[...],attention_factor=F,original=N]   or   longrope:FILE.json[,...]
    proportional:P[,factor=S]                         (p-RoPE: the fraction P of frequency pairs that rotate)

Any kind also takes ``replace=true``: rewrite parameters that already scale RoPE (hf/rope_spec.py).

A longrope FILE.json holds ``long_factor`` / ``short_factor`` (and optionally ``factor``,
``attention_factor``, ``original_max_position_embeddings``) at its top level or under
``rope_scaling`` / ``rope_parameters``, so a Phi-3 ``config.json`` works as it is (its s is then
``max_position_embeddings / original_max_position_embeddings``). Keys given inline win over the file.
Transformers only warns on fields that contradict each other (llama3 low >= high, LongRoPE lists of
the wrong length, an mscale without its mscale_all_dim); here each is a one-line error naming the fix.
The same kinds, trained or evaluated in our GPT: ``rotary-yarn``, ``rotary-llama3``,
``rotary-longrope``, ``rotary-proportional`` (positional/), tested equal to transformers.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..io import UserError
from ..positional.base import SchemeError
from ..positional.rotary_yarn import RotaryYaRN

KINDS = ("linear", "dynamic", "yarn", "ntk", "llama3", "longrope", "proportional")
SYNTAX = ("KIND:FACTOR[,key=value] (KIND in linear, dynamic, yarn, ntk, llama3; longrope:long=[...]; "
          "proportional:P)")
_ORIG = "original_max_position_embeddings"
#: CLI key (and its Hugging Face name) -> Hugging Face key, per kind
KEYS = {
    "linear": {}, "dynamic": {}, "ntk": {},
    "yarn": {"original": _ORIG, "beta_fast": "beta_fast", "beta_slow": "beta_slow", "attention_factor":
             "attention_factor", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim", "truncate": "truncate"},
    "llama3": {"low": "low_freq_factor", "high": "high_freq_factor", "original": _ORIG},
    "longrope": {"short": "short_factor", "long": "long_factor", "factor": "factor", "attention_factor":
                 "attention_factor", "original": _ORIG},
    "proportional": {"factor": "factor"},
}
#: ``replace=true``: a rewrite of parameters that already scale RoPE replaces them (hf/rope_spec.py); any kind
REPLACE = "replace"
LISTS, BOOLS, INTS = ("short_factor", "long_factor"), ("truncate", REPLACE), (_ORIG,)


def split_top(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside brackets (``a=[1,2],b=3`` -> ``a=[1,2]``, ``b=3``)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _value(kind: str, key: str, raw: str, text: str):
    raw = raw.strip()
    try:
        if key in LISTS:
            if not (raw.startswith("[") and raw.endswith("]")):
                raise ValueError
            out = [float(x) for x in raw[1:-1].split(",") if x.strip()]
            if not out or not all(math.isfinite(x) for x in out):
                raise ValueError
            return out
        if key in BOOLS:
            return {"true": True, "false": False}[raw.lower()]
        x = float(raw)
        if not math.isfinite(x) or (key in INTS and x != int(x)):
            raise ValueError
        return int(x) if key in INTS else x
    except (ValueError, KeyError):
        what = ("a list of numbers in brackets, e.g. long=[1,1.5,2,4]" if key in LISTS else "true or false"
                if key in BOOLS else "a whole number" if key in INTS else "a number")
        raise UserError(f"--rope {kind}: {key} takes {what}; got {raw!r} in {text!r}") from None


def _from_file(path: str, text: str) -> dict:
    """LongRoPE fields from a JSON file (module doc)."""
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"--rope longrope:{path}: cannot read it as JSON ({type(e).__name__}); pass a file holding "
                        "long_factor and short_factor lists, e.g. the model's config.json") from None
    block = next((data[k] for k in ("rope_scaling", "rope_parameters") if isinstance(data.get(k), dict)), data) \
        if isinstance(data, dict) else {}
    out = {k: block[k] for k in ("short_factor", "long_factor", "factor", "attention_factor", _ORIG)
           if block.get(k) is not None}
    if _ORIG not in out and isinstance(data.get(_ORIG), int):
        out[_ORIG] = data[_ORIG]
    if "factor" not in out and isinstance(data.get("max_position_embeddings"), int) and out.get(_ORIG):
        out["factor"] = data["max_position_embeddings"] / out[_ORIG]  # Phi-3: s = 131072 / 4096
    if "long_factor" not in out:
        raise UserError(f"--rope longrope:{path} has no long_factor list (top level, rope_scaling or rope_parameters); "
                        "pass long=[...] inline or a file that has one")
    for key in ("short_factor", "long_factor"):
        if key in out:
            out[key] = _value("longrope", key, json.dumps(out[key]).replace(" ", ""), text)
    return out


def parse_rewrite(kind: str, args: str, text: str) -> tuple[float | None, dict]:
    """(the positional number or None, {Hugging Face key: value}) of one ``KIND:ARGS``, or a one-line UserError."""
    names = {**KEYS[kind], **{v: v for v in KEYS[kind].values()}}  # the short names and transformers' own
    number, params, from_file = None, {}, {}
    for item in (split_top(args, ",") if args else []):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            if number is not None or from_file:
                raise UserError(f"--rope {kind} takes one positional value; got {text!r} ({SYNTAX})")
            if kind == "longrope" and key.lower().endswith(".json"):
                from_file = _from_file(key, text)
                continue
            try:
                number = float(key)
            except ValueError:
                number = float("nan")
            if not math.isfinite(number):
                raise UserError(f"--rope takes one KIND:FACTOR with FACTOR >= 1, e.g. --rope yarn:4 ({SYNTAX}); "
                                f"got {text!r}")
        elif key == REPLACE:
            params[REPLACE] = _value(kind, REPLACE, raw, text)
        elif key in names:
            if names[key] in params:
                raise UserError(f"--rope {kind} got {names[key]} twice; give it once ({text!r})")
            params[names[key]] = _value(kind, names[key], raw, text)
        else:
            valid = ", ".join([*KEYS[kind], REPLACE])
            raise UserError(f"--rope {kind} has no option {key!r}; its options: {valid} ({text!r})")
    return number, {**from_file, **params}


def check_factor(kind: str, s, text: str, example: str) -> float:
    if s is None or not s >= 1.0 or not math.isfinite(s):
        raise UserError(f"--rope takes one KIND:FACTOR with FACTOR >= 1, e.g. --rope {example}; got {text!r}")
    return float(s)


def rope_parameters(kind: str, number, params: dict, rp: dict, head_dim: int, orig: int | None, text: str) -> dict:
    """The new ``rope_parameters`` for ``kind`` (``rp``: the model's current ones, ``head_dim`` its head size,
    ``orig`` the L_tr to scale from), every field checked (module doc)."""
    keep = {k: rp[k] for k in ("rope_theta", "partial_rotary_factor") if k in rp}
    prf = float(keep.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * prf)  # the rotated dimensions, as transformers computes them
    if kind == "ntk":
        s = check_factor(kind, number, text, "ntk:4")
        return {**keep, "rope_type": "default", "rope_theta": keep["rope_theta"] * s ** (dim / (dim - 2))}
    if kind == "proportional":
        p = float("nan") if number is None else number
        if not 0.0 <= p <= 1.0:
            raise UserError(f"--rope proportional:P takes the fraction P in [0, 1] of frequency pairs that rotate "
                            f"(Gemma 4: proportional:0.25); got {text!r}")
        if prf != 1.0:
            raise UserError(f"--rope proportional sets which pairs rotate, but this model already rotates only "
                            f"partial_rotary_factor={prf:g} of each head; drop --rope proportional")
        new = {**keep, "rope_type": "proportional", "partial_rotary_factor": p}
        if params.get("factor", 1.0) != 1.0:
            new["factor"] = check_factor(kind, params["factor"], text, "proportional:0.25,factor=2")
        return new
    if kind == "longrope":
        return _longrope(number, params, keep, dim, orig, text)
    s = check_factor(kind, number, text, f"{kind}:4")
    new = {**keep, "rope_type": kind, "factor": s, **params}
    if kind in ("yarn", "llama3"):
        new[_ORIG] = int(params.get(_ORIG) or orig)
    if kind == "llama3":
        new.setdefault("low_freq_factor", 1.0)
        new.setdefault("high_freq_factor", 4.0)
        low, high = new["low_freq_factor"], new["high_freq_factor"]
        if not 0 < low < high:
            raise UserError(f"--rope llama3 needs 0 < low < high (wavelength bands L/low > L/high), got low={low:g}, "
                            f"high={high:g}; Llama 3.1 uses llama3:8,low=1,high=4")
    if kind == "yarn":
        _check_yarn(new, s, text)
    return new


def _check_yarn(new: dict, s: float, text: str) -> None:
    try:  # the same checks as our rotary-yarn (the one implementation of the rule)
        RotaryYaRN(1, factor=s, original_length=new[_ORIG], beta_fast=new.get("beta_fast", 32.0),
                   beta_slow=new.get("beta_slow", 1.0), attention_factor=new.get("attention_factor"),
                   mscale=new.get("mscale"), mscale_all_dim=new.get("mscale_all_dim"),
                   truncate=new.get("truncate", True))
    except SchemeError as e:
        msg = str(e).replace("rotary-yarn", "--rope yarn").split("; pass --set")[0]
        raise UserError(f"{msg} ({text!r})") from None


def _longrope(number, params: dict, keep: dict, dim: int, orig: int | None, text: str) -> dict:
    params = dict(params)
    if number is not None:
        if "factor" in params and params["factor"] != number:
            raise UserError(f"--rope longrope got the factor twice ({number:g} and factor={params['factor']:g}); "
                            f"give it once ({text!r})")
        params["factor"] = number
    n = dim // 2
    if "long_factor" not in params:
        raise UserError(f"--rope longrope needs the long factors: long=[{n} numbers] (one per frequency pair, "
                        f"from the model card or LongRoPE's search) or longrope:FILE.json; got {text!r}")
    params.setdefault("short_factor", [1.0] * n)  # plain RoPE up to L_tr
    for key in ("short_factor", "long_factor"):
        vals = params[key]
        if len(vals) != n:
            raise UserError(f"--rope longrope: {key} has {len(vals)} entries but this model rotates {dim} dimensions "
                            f"per head, {n} frequency pairs; give {n} numbers")
        if not all(v > 0 for v in vals):
            raise UserError(f"--rope longrope: every {key} entry must be > 0 (theta_i is divided by it); got {text!r}")
    if "factor" in params:
        params["factor"] = check_factor("longrope", params["factor"], text, "longrope:16,long=[...]")
    f = params.get("attention_factor")
    if f is not None and not f > 0:
        raise UserError(f"--rope longrope: attention_factor must be > 0; got {text!r}")
    if "factor" not in params and f is None:
        raise UserError(f"--rope longrope needs the extension s for its attention factor sqrt(1 + ln s / ln L_tr): "
                        f"longrope:S,long=[...] (S = target length / L_tr) or attention_factor=F; got {text!r}")
    return {**keep, "rope_type": "longrope", _ORIG: int(params.pop(_ORIG, None) or orig), **params}
