"""Load a Hugging Face causal LM + tokenizer from a local folder or GGUF file (``hf:PATH``); never a download.

``from_pretrained(path, local_files_only=True)`` for config, weights and tokenizer; a GGUF file
(llama.cpp) is converted once into a plain folder under ``<cache_dir>/gguf/`` and loaded from there
(:mod:`.gguf`; the run record's ``gguf`` block says which file, sha256 and quantisation). What the
rest of extrapolab needs to know about the model is read from its config once, here:

* ``positions`` -- how it encodes position: ``learned`` (GPT-2 ``n_positions``, OPT, GPT-Neo:
  a table of absolute embeddings, so no length past it can be encoded), ``rope`` (GPT-NeoX /
  Pythia, Llama, Mistral, Qwen2, ...: any length runs), ``alibi`` (BLOOM, MPT: any length runs);
  an unlisted family counts as ``learned`` when it owns an embedding module named like a
  position table, else ``unknown`` (any length is tried);
* ``train_length`` -- the L_tr extrapolab compares against: the config's pre-training length
  (``max_position_embeddings`` / ``n_positions`` / ``max_seq_len``), or the caller's.

``--rope KIND:S`` rewrites the config's RoPE parameters *before* the model is built, so HF's own
rotary implementation (``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``) does the work:
``linear`` = position interpolation (Chen et al. 2023, "Extending Context Window of Large
Language Models via Positional Interpolation", eq. 4: positions x 1/s), ``dynamic`` = dynamic
NTK (s recomputed from the input length at run time), ``yarn`` = YaRN (Peng et al. 2023, §3.3-3.4:
ramp over frequency bands, attention factor 0.1 ln s + 1; DeepSeek's mscale / mscale_all_dim,
truncate), ``llama3`` (Llama 3.1: low/high frequency factors, 1 and 4 by default), ``longrope``
(LongRoPE / Phi-3: short and long factor lists), ``proportional`` (p-RoPE / Gemma 4: only the
fraction P of frequency pairs rotates), and ``ntk`` = static NTK-aware scaling (bloc97 2023: base
x s^(d/(d-2))), which HF has no rope type for, so it is applied as a new ``rope_theta`` of HF's
default RoPE. The kinds' ``key=value`` fields and their checks: :mod:`.rope_kinds`. On a model with layer
types (``layer_types``, ``rope_parameters`` nested per type: Gemma 3) a rewrite applies to every RoPE type, or
with ``@TYPE`` to that type only (``--rope yarn:4@full``: the global layers of Gemma 3); :mod:`.layer_types`.

The extensions HF has no rope type for run in transformers' attention-function registry
(:mod:`.extend`): ``selfextend:G,w`` (Self-Extend, Jin et al. 2024; w defaults to L_tr/4),
``rerope:w`` and ``rerope-leaky:w,k`` (ReRoPE, Su 2023; w defaults to L_tr/8, k to 16),
``dca:C,w`` (dual chunk attention, An et al. 2024: largest query position C, default 3/4·L_tr, local
window w, default C/6, as ChunkLlama; without the q, k scaling by 0.05 ln(L/L_tr) + 1 of its Hugging Face
patch, as vLLM's DCA: positional/rotary_dca.py), ``streaming:K,W`` (StreamingLLM's pattern, Xiao et al. 2024:
K attention sinks, default 4, and a window of W keys, default L_tr - K) and ``logn`` (q x max(1,
log(m+1)/log L_tr); ``logn:L`` names L_tr). Parts combine with ``+``: at most one rewrite, one
multi-pass method and ``logn``, e.g. ``--rope rerope:512+logn`` (the ReRoPE patch) or ``--rope
yarn:2+logn``; a multi-pass method with
``dynamic`` or ``longrope`` is refused (their frequencies change with the length). Such a model is
loaded with ``attn_implementation="extrapolab"``.
"""
from __future__ import annotations

import hashlib
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..io import UserError
from ..positional.rotary_dca import default_chunk
from . import extend, layer_types, rope_kinds

PREFIX = "hf:"
#: model_type -> how it encodes positions (families the tests build; see module doc for others)
POSITIONS = {"gpt2": "learned", "opt": "learned", "gpt_neo": "learned", "biogpt": "learned",
             "gpt_neox": "rope", "llama": "rope", "mistral": "rope", "qwen2": "rope", "qwen3": "rope",
             "gptj": "rope", "phi3": "rope", "gemma": "rope", "gemma2": "rope", "gemma3_text": "rope",
             "bloom": "alibi", "mpt": "alibi"}
ROPE_KINDS = rope_kinds.KINDS
ROPE_SYNTAX = (f"{rope_kinds.SYNTAX}, selfextend:G[,w], rerope[:w], rerope-leaky[:w[,k]], dca[:C[,w]], "
               "streaming[:K[,W]], logn[:L_tr], joined by +; KIND:ARGS@TYPE rewrites one layer type's")
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "seq_length")


@dataclass
class HFModel:
    """A loaded HF causal LM and what extrapolab reads from it."""

    model: torch.nn.Module
    tokenizer: object
    path: Path  # what hf: named: the folder, or the GGUF file (its converted folder is in info["gguf"])
    name: str
    family: str  # config.model_type
    positions: str  # learned | rope | alibi | unknown
    train_length: int | None  # L_tr: the config's pre-training length (None if it has none)
    max_length: int | None  # longest encodable input (learned positions only)
    attn_implementation: str
    rope: str | None = None
    info: dict = field(default_factory=dict)


def rope_tag(text: str) -> str:
    """``--rope`` text as a file-name part: ``yarn:4`` -> ``yarn4``, ``rerope:512+logn`` -> ``rerope512-logn``,
    ``yarn:4@full`` -> ``yarn4-full``;
    a text with lists or a file: its kind and a hash of the text, so the name stays short."""
    tag = str(text).replace(":", "").replace(",", "_").replace("+", "-").replace("@", "-")
    if not re.fullmatch(r"[\w.=-]{0,64}", tag):
        tag = f"{str(text).partition(':')[0]}-{hashlib.sha256(str(text).encode()).hexdigest()[:10]}"
    return tag


def default_out(loaded: "HFModel") -> Path:
    """runs/hf-<folder name>[-<rope kind><factor>]: where eval, align and erf of hf:PATH write by default
    (a --rope with lists or a file: its kind and a hash of its text, so the folder name stays short)."""
    tag = "-" + rope_tag(loaded.rope) if loaded.rope else ""
    return Path("runs") / f"hf-{loaded.name}{tag}"


def is_hf_spec(spec) -> bool:
    return str(spec).startswith(PREFIX)


def hf_path(spec) -> Path:
    """``hf:PATH`` (or a bare path) -> a folder holding config.json or a file (a GGUF, checked when
    loaded), else one-line error."""
    text = str(spec)
    path = Path(text[len(PREFIX):] if text.startswith(PREFIX) else text).expanduser()
    if not (path.is_file() or (path / "config.json").is_file()):
        raise UserError(f"{path} is neither a Hugging Face model folder (no config.json) nor a GGUF file; pass "
                        "hf:DIR with a folder written by save_pretrained or hf:FILE.gguf (extrapolab never downloads)")
    return path


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("hf: models need `transformers`; install it (pip install -e '.[hf]')") from None
    return transformers


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    spec = (spec or "auto").lower()
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if spec not in table:
        raise UserError(f"unknown --dtype {spec!r}; use auto, fp32 or bf16")
    return table[spec]


def config_train_length(config) -> int | None:
    for key in _LENGTH_KEYS:
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def position_kind(config, model=None) -> str:
    kind = POSITIONS.get(config.model_type)
    if config.model_type == "falcon":
        kind = "alibi" if getattr(config, "alibi", False) else "rope"
    if kind is None and model is not None:
        named = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding) and "pos" in n.lower()]
        kind = "learned" if named else "unknown"
    return kind or "unknown"


@dataclass(frozen=True)
class RopeSpec:
    """A parsed ``--rope``: a rope_parameters rewrite, a two-pass method, log-n (each optional)."""

    text: str
    rewrite: tuple[str, float | None] | None = None  # (kind, factor; proportional: the fraction p)
    rewrite_params: dict = field(default_factory=dict)  # its key=value fields, as rope_parameters keys
    layer_type: str | None = None  # KIND:ARGS@TYPE: the rewrite of that layer type's rope_parameters only
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
    out: dict = {"rewrite": None, "rewrite_params": {}, "method": None, "params": {}, "logn": None, "layer_type": None}
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


def apply_rope(config, spec: str | RopeSpec, original: int | None = None) -> dict | None:
    """Rewrite ``config.rope_parameters`` for the spec's rewrite part (see module doc); returns the
    new parameters (None when the spec has no rewrite, only checks that the model uses RoPE).
    ``original``: the pre-training length YaRN / llama3 scale from (default: the config's)."""
    spec = spec if isinstance(spec, RopeSpec) else parse_rope(spec)
    rp = getattr(config, "rope_parameters", None)
    nested = layer_types.nested_types(config)
    if position_kind(config) != "rope" or not isinstance(rp, dict) or ("rope_theta" not in rp and not nested):
        raise UserError(f"--rope applies to RoPE models, but this {config.model_type} model has no "
                        "rope_parameters; drop --rope")
    if spec.rewrite is None:
        return None
    kind, number = spec.rewrite
    orig = int(original) if original else config_train_length(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rewrite = lambda old: rope_kinds.rope_parameters(kind, number, spec.rewrite_params, old, head_dim, orig,  # noqa: E731
                                                     spec.text)
    if nested or spec.layer_type:  # per layer type (hf/layer_types.py): that type's, or every RoPE type's
        which = [layer_types.resolve(config, spec.layer_type, spec.text)] if spec.layer_type else \
            [k for k in nested if rp[k] is not None]
        new = dict(rp)
        for key in which:
            if rp[key] is None:
                raise UserError(f"--rope {spec.text}: layer type {key} has no RoPE (a NoPE layer); drop @TYPE or name "
                                f"a RoPE type: {', '.join(layer_types.short(k) for k in nested if rp[k] is not None)}")
            new[key] = rewrite(rp[key])
            if "truncate" in new[key]:  # transformers' YaRN reads it at the top level only (module doc)
                new["truncate"] = new[key]["truncate"]
    else:
        new = rewrite(rp)
    config.rope_parameters = new
    try:
        if hasattr(config, "validate_rope"):
            config.validate_rope()
    except (ValueError, KeyError) as e:
        raise UserError(f"transformers rejects --rope {spec.text}: {str(e).splitlines()[0]}") from None
    return new


def _from_pretrained(tr, path: Path, attn: str, kw: dict):
    try:
        try:
            model = tr.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=attn, **kw)
        except ValueError as e:
            msg = str(e).lower()
            if attn == "eager" or not ("attn" in msg or "attention" in msg):
                raise
            attn = "eager"  # the family has no such kernel (BLOOM, MPT): its own eager attention
            model = tr.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=attn, **kw)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load the causal LM in {path}: {str(e).splitlines()[0]}; save it with "
                        "save_pretrained (weights + config)") from None
    return model, attn


@contextmanager
def _quiet(tr):
    """No HF progress bars while loading a tiny or local model (restored after)."""
    hl = tr.utils.logging
    was = hl.is_progress_bar_enabled()
    hl.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hl.enable_progress_bar()


def load_hf(spec, *, device: str | torch.device = "cpu", dtype: str = "auto", attn: str = "sdpa",
            rope: str | None = None, train_length: int | None = None, cache_dir=None) -> HFModel:
    """Model (eval mode, on ``device``) + tokenizer from the local folder or GGUF file of ``spec``.

    ``attn``: HF ``attn_implementation``; ``sdpa`` (never an L x L tensor for the RoPE / GPT-2
    families) falls back to ``eager`` where the family has only that (BLOOM, MPT);
    ``"extrapolab"`` (hf/extend.py, forced by a ``--rope`` extension) runs our attention, which
    feeds alignment statistics block-wise; ``eager`` returns attention probabilities.
    ``cache_dir``: where a GGUF file's converted folder lives (default ``data.cache_dir``'s
    default, ``.extrapolab-cache``).
    """
    tr = _transformers()
    source = hf_path(spec)
    gguf = None
    if source.is_file():
        from ..config import DataConfig
        from .gguf import gguf_folder

        with _quiet(tr):
            path, gguf = gguf_folder(source, cache_dir or DataConfig.cache_dir, tr)
    else:
        path = source
    if not isinstance(device, torch.device):
        from ..train.dist import resolve_device

        device = resolve_device(str(device))
    torch_dtype = resolve_dtype(dtype, device)
    try:
        config = tr.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot read {path}/config.json ({str(e).splitlines()[0]}); pass a folder written by "
                        "save_pretrained") from None
    spec = parse_rope(rope) if rope else None
    rope_params = apply_rope(config, spec, train_length) if spec else None
    if (spec is not None and spec.extends) or attn == extend.ATTN:
        attn = extend.register()  # Self-Extend / ReRoPE / log-n / block statistics: our attention function
    kw = dict(config=config, local_files_only=True, dtype=torch_dtype)
    with _quiet(tr):
        model, attn = _from_pretrained(tr, path, attn, kw)
    try:
        tok = tr.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means the folder has no usable tokenizer
        raise UserError(f"no usable tokenizer in {path} ({type(e).__name__}); save one there with "
                        "tokenizer.save_pretrained") from None
    model = model.to(device).eval()
    kind = position_kind(config, model)
    L_tr = int(train_length) if train_length else config_train_length(config)
    extension = None
    if spec is not None and spec.extends:
        if not L_tr:
            raise UserError(f"--rope {spec.text} needs the training length; pass --train-length")
        if spec.method == "dca":
            params = {"chunk": default_chunk(L_tr), "w": None, **spec.params}
        elif spec.method == "streaming":
            params = {"sinks": 4, "w": None, **spec.params}
        else:
            params = {"w": max(1, L_tr // (4 if spec.method == "selfextend" else 8)), "k": 16.0, **spec.params}
        logn = None if spec.logn is None else (spec.logn or L_tr)
        extension = extend.install(model, spec.method, params, logn, L_tr)
    max_len = config_train_length(config) if kind == "learned" else None
    info = {"rope_parameters": rope_params, "rope_extension": extension, "layer_types": layer_types.summary(config),
            "dtype": str(torch_dtype).replace("torch.", ""),
            "device": str(device), "parameters": sum(p.numel() for p in model.parameters())}
    if gguf is not None:
        info["gguf"] = gguf
    return HFModel(model=model, tokenizer=tok, path=source, name=source.stem if gguf else source.name,
                   family=config.model_type, positions=kind, train_length=L_tr, max_length=max_len,
                   attn_implementation=getattr(model.config, "_attn_implementation", attn), rope=rope, info=info)
