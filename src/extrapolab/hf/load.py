"""Load a Hugging Face causal LM + tokenizer from a local folder or GGUF file (``hf:PATH``); never a download.

``from_pretrained(path, local_files_only=True)`` for config, weights and tokenizer; a GGUF file
(llama.cpp) is converted once into a plain folder under ``<cache_dir>/gguf/`` and loaded from there
(:mod:`.gguf`; the run record's ``gguf`` block says which file, sha256 and quantisation). What the
rest of extrapolab needs to know about the model is read from its config once, here:

* ``positions`` -- how it encodes position: ``rope`` when the config has ``rope_parameters`` and
  transformers built a rotary embedding from them (:func:`.rope_spec.uses_rope`, :func:`rotary_buffers`:
  GPT-NeoX / Pythia, Llama, Mistral, Qwen2, Gemma 2 / 3, Cohere2, Llama 4, SmolLM3, gpt-oss, ...: any
  length runs), ``learned`` (GPT-2 ``n_positions``, OPT, GPT-Neo: a table of absolute embeddings, so no
  length past it can be encoded; GPT-J and CodeGen, RoPE from their own ``rotary_dim`` table, count as
  ``rope`` too), ``alibi`` (BLOOM, MPT, Falcon with ``alibi``: any length runs); another
  model counts as ``learned`` when it owns an embedding module named like a position table, else
  ``unknown`` (any length is tried). A malformed ``rope_parameters`` is a one-line error here
  (:func:`.rope_spec.check_rope_parameters`);
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
A rewrite of parameters that already scale RoPE (gpt-oss's YaRN, Gemma 3 4B's linear x8) needs
``replace=true`` (:mod:`.rope_spec`); the run record keeps ``rope_parameters_before`` and ``rope_parameters``.

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
loaded with ``attn_implementation="extrapolab"``, each layer's rotation measured on it (:mod:`.geometry`,
``rotary_layers`` in the run record), its chunked masks honoured (:mod:`.masks`).
"""
from __future__ import annotations

import copy
import hashlib
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..io import UserError
from ..positional.rotary_dca import default_chunk
from . import extend, geometry, layer_types
from .rope_spec import (ROPE_KINDS, ROPE_SYNTAX, RopeSpec, apply_rope, check_rope_parameters,  # noqa: F401
                        config_train_length, parse_rope, uses_rope)

PREFIX = "hf:"
#: model_type -> positions for families without RoPE whose config does not say how they encode them
NOT_ROPE = {"gpt2": "learned", "opt": "learned", "gpt_neo": "learned", "biogpt": "learned", "bloom": "alibi",
            "mpt": "alibi"}


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


def rotary_buffers(model) -> dict:
    """{name: inverse frequencies} of every rotary embedding transformers built (buffers named ``inv_freq`` or
    ``<layer type>_inv_freq``; their ``original_`` copies left out)."""
    return {n: b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].endswith("inv_freq")
            and "original_" not in n.rsplit(".", 1)[-1]}


def rotary_layers(model) -> dict | None:
    """The run record's ``rotary_layers``: which layers rotate and their pairs, where measured (hf/geometry.py)."""
    rotations = (getattr(model.config, "extrapolab_rope", None) or {}).get("rotations")
    return None if rotations is None else geometry.summary(rotations)


def position_kind(config, model=None) -> str:
    """rope | learned | alibi | unknown, from the config (``rope_parameters``, :func:`.rope_spec.uses_rope`) and,
    with ``model``, the rotary embedding transformers built from it (module doc)."""
    if config.model_type == "falcon" and getattr(config, "alibi", False):
        return "alibi"
    if config.model_type in NOT_ROPE:
        return NOT_ROPE[config.model_type]
    if uses_rope(config) and (model is None or rotary_buffers(model)):
        return "rope"
    if getattr(config, "rotary_dim", None):  # GPT-J, CodeGen: RoPE from their own table, no rope_parameters
        return "rope"
    if model is not None:
        named = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding) and "pos" in n.lower()]
        return "learned" if named else "unknown"
    return "unknown"


def _config_error(path: Path, e: Exception) -> str:
    """One line for a config.json transformers cannot read: the field and its value where it names one."""
    why = " ".join(str(e).split())
    bad = re.search(r"[Ff]ield '(\w+)' with value (.{1,60}?) doesn't match", why)
    if bad:
        what = " (a mapping such as {\"rope_type\": \"default\", \"rope_theta\": 10000.0})" \
            if bad.group(1) == "rope_parameters" else ""
        return (f"cannot read {path}/config.json: its field {bad.group(1)!r} is {bad.group(2)}, of a type transformers "
                f"does not accept; fix {bad.group(1)} there{what}")
    fix = "fix rope_parameters there" if "rope" in why.lower() else "pass a folder written by save_pretrained"
    return f"cannot read {path}/config.json ({type(e).__name__}: {why[:300]}); {fix}"


def _from_pretrained(tr, path: Path, attn: str, kw: dict):
    try:
        try:
            model = tr.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=attn, **kw)
        except (ValueError, KeyError) as e:
            msg = str(e).lower()
            if attn == extend.ATTN:  # never a silent fallback: the methods would not run (a one-line error)
                raise UserError(f"{kw['config'].model_type} models do not run a registered attention function "
                                f"(transformers: {str(e).splitlines()[0][:160]}), so the extrapolab attention "
                                "cannot serve them (--rope METHOD / logn, --protocol cached, block-wise alignment); "
                                "use a rope_parameters rewrite or drop it") from None
            if attn == "eager" or isinstance(e, KeyError) or not ("attn" in msg or "attention" in msg):
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
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, KeyError, huggingface_hub's field validation
        raise UserError(_config_error(path, e)) from None
    check_rope_parameters(config, f"{path}/config.json")
    spec = parse_rope(rope) if rope else None
    before = copy.deepcopy(getattr(config, "rope_parameters", None))
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
    info = {"rope_parameters": rope_params, "rope_parameters_before": before if rope_params is not None else None,
            "rope_extension": extension, "rotary_layers": rotary_layers(model),
            "layer_types": layer_types.summary(config),
            "dtype": str(torch_dtype).replace("torch.", ""),
            "device": str(device), "parameters": sum(p.numel() for p in model.parameters())}
    if gguf is not None:
        info["gguf"] = gguf
    return HFModel(model=model, tokenizer=tok, path=source, name=source.stem if gguf else source.name,
                   family=config.model_type, positions=kind, train_length=L_tr, max_length=max_len,
                   attn_implementation=getattr(model.config, "_attn_implementation", attn), rope=rope, info=info)
