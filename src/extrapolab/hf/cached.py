"""E5 cached-window decoding on a Hugging Face RoPE model, with StreamingLLM's attention sinks
(Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks", ICLR 2024, arXiv
2309.17453, §3.2; mit-han-lab/streaming-llm ``StartRecentKVCache`` and ``pos_shift``).

``eval/cached.py`` asks the model for its cache (``HFCausalLM.new_cache``) and calls it token by
token; :class:`HFWindowCache` keeps the first tokens (the window prefix, then ``sinks``) and the
newest ``window`` of a transformers ``DynamicCache``, and each call runs the model

* at position 0 (``position_ids`` all zero): the model's own rotary embedding rotates by angle 0,
  so q and the keys the cache stores are *before rotation* (times the rope type's attention
  factor, which a rotation by any angle keeps);
* with the registered attention function (hf/extend.py, ``attn_implementation="extrapolab"``,
  switched on with ``set_attn_implementation``: no model class is patched) and its
  ``extrapolab_in_cache`` keyword: every cached key is rotated at its position in the cache,
  0..n-1, and the queries at theirs, the last ones, in each layer's layout and frequencies as
  measured on the model (hf/geometry.py; a NoPE layer's are left as they are).

Every layer of the ``DynamicCache`` is a full one (not the sliding or chunked layers transformers
builds from the config, which would drop keys themselves): a sliding layer's window and a chunked
layer's chunks (Llama 4, hf/masks.py) then apply at the cache positions, as in the re-encoded tokens.

So attention sees exactly what re-encoding the kept tokens from position 0 would give it (for
one layer, tests/test_streaming_hf.py), never keys left at the positions they were written at (the
rotated-key caches of transformers#35350 and TGI#1105). Without sinks it is the plain window at
cache positions: for RoPE the same logits as keys rotated at absolute positions. The window
prefix (BOS where the tokenizer adds one, hf/adapter.py) is the stream's first token and stays in
the cache in front of the sinks, as every E1 window starts with it.
"""
from __future__ import annotations

import torch

from ..io import UserError
from . import extend, geometry


def prepare(model) -> None:
    """Switch an ``HFCausalLM`` to the registered attention, with each layer's rotation measured
    (hf/geometry.py; idempotent), or a one-line UserError for a model this cannot serve."""
    loaded = model.loaded
    if loaded.positions != "rope":
        raise UserError(f"protocol 'cached' (E5) is not available for HF models without RoPE ({loaded.family} "
                        f"encodes positions as {loaded.positions}): its cache places keys by rotating them; use "
                        "recomputed or nonoverlapping")
    rp = getattr(model.hf.config, "rope_parameters", None) or {}
    kinds = [rp.get("rope_type")] + [v.get("rope_type") for v in rp.values() if isinstance(v, dict)]
    if "dynamic" in kinds:
        raise UserError("cached-window E5 needs fixed rotary frequencies; --rope dynamic changes them with the "
                        "length: drop it")
    if getattr(model.hf.config, "_attn_implementation", None) != extend.ATTN:
        extend.register()
        model.hf.set_attn_implementation(extend.ATTN)
        loaded.attn_implementation = extend.ATTN
    spec = dict(getattr(model.hf.config, "extrapolab_rope", None) or {})
    if "rotations" not in spec:
        spec["rotations"] = geometry.measure(model.hf, geometry.far_position(model.hf.config, loaded.train_length))
        model.hf.config.extrapolab_rope = spec
        loaded.info["rotary_layers"] = geometry.summary(spec["rotations"])


class HFWindowCache:
    """The first ``keep`` tokens and the newest ``window`` of a ``DynamicCache`` of unrotated keys."""

    def __init__(self, model, window: int, sinks: int | None = None) -> None:
        from transformers import DynamicCache

        prepare(model)
        self.window = int(window)
        self.keep = len(model.prefix) + int(sinks or 0)  # the prefix, then the sinks
        self.cache = DynamicCache()  # full layers: the window and sinks are ours, sliding / chunked by slot
        self.started = False

    def step(self, model, idx: torch.Tensor) -> torch.Tensor:
        """idx [B, L] the next tokens -> their logits [B, L, V]; the first call puts the window prefix in
        front. L must fit: at most keep + window tokens in the first call, one token per call after.
        (A temperature is the caller's scope, ``HFCausalLM.forward``.)"""
        P = 0 if self.started else len(model.prefix)
        if P:
            pre = torch.tensor(model.prefix, dtype=torch.long, device=idx.device).expand(idx.shape[0], -1)
            idx = torch.cat([pre, idx], dim=1)  # [B, P + L]
        n = self.cache.get_seq_length()
        if idx.shape[1] > 1 and n + idx.shape[1] > self.keep + self.window:
            raise UserError(f"the cached window takes one token per call once it holds keep + window = "
                            f"{self.keep + self.window} tokens; got {idx.shape[1]}")
        out = model.hf(input_ids=idx, position_ids=torch.zeros_like(idx), past_key_values=self.cache, use_cache=True,
                       **{extend.STREAM_KWARG: True})
        self.started = True
        self._evict()
        return out.logits[:, P:]  # [B, L, V]

    def _evict(self) -> None:
        """Keep the first ``keep`` and the newest ``window - 1`` keys: the next token makes ``window``."""
        top = self.keep + self.window - 1
        for layer in self.cache.layers:
            n = layer.keys.shape[2]
            if n > top:
                recent = slice(n - (self.window - 1), n)
                layer.keys = torch.cat([layer.keys[:, :, :self.keep], layer.keys[:, :, recent]], dim=2)
                layer.values = torch.cat([layer.values[:, :, :self.keep], layer.values[:, :, recent]], dim=2)
