"""Training-free context extension inside Hugging Face RoPE models, through transformers' own
attention-function registry (``AttentionInterface.register``), never a copied or patched class.

``--rope selfextend:G,w | rerope:w | rerope-leaky:w,k | dca:C,w | streaming:K,W | logn`` (hf/load.py) loads the
model with
``attn_implementation="extrapolab"``: every attention layer then calls :func:`extend_attention`
with the q, k Hugging Face has already rotated (with the rope type's attention factor inside cos/sin),
v, the module's ``scaling``, ``sliding_window`` and ``softcap``, its ``position_ids`` and the mask the
registered mask function returned (hf/masks.py: None, or Llama 4's chunks). The function repeats the
key/value heads (GQA), puts ``scaling`` into q (so attention's 1/sqrt(d) gives the model's own scale,
including a temperature ``hf_temperature`` set) and runs our :func:`extrapolab.model.attention.attend`
with the layer's :class:`HFRope` -- chunk by chunk on a chunked layer (hf/masks.py) -- whose hooks are:

* ``rotate``: nothing to rotate (Hugging Face did), only the log-n factor on q
  (``positional.rotary.logn_scale``: max(1, log(m + 1)/log L_tr), the ReRoPE and Self-Extend patches;
  every layer, NoPE ones included);
* ``second_pass``: Self-Extend (Jin et al. 2024, arXiv 2401.01325, Algorithm 1), ReRoPE / leaky
  ReRoPE (Su 2023, github.com/bojone/rerope), dual chunk attention (An et al. 2024, arXiv
  2402.17463, eqs. 2-8; positional/rotary_dca.py) or StreamingLLM's sinks + window (Xiao et al.
  2024, arXiv 2309.17453; positional/rotary_streaming.py): re-rotating the rotated q, k by the angle
  (p' - m)·theta_i puts them at each pass's positions p' exactly (positional/rope_twopass.py), with
  the layer's own frequencies and pair layout, measured on the model at load time (hf/geometry.py:
  Gemma 3's two bases, Cohere2's and Llama 4's pairs (2i, 2i + 1)). A NoPE layer (Llama 4's, SmolLM3's,
  Cohere2's full layers) is not re-rotated: the passes only move positions, so it attends plainly, except
  that StreamingLLM's pattern still leaves its other keys unseen;
* ``scores``: transformers' ``softcap`` (Gemma 2's ``attn_logit_softcapping``), tanh(l/c)·c on the scaled
  logits before the mask, as its eager attention does; such layers take the reference path.

So the passes run in the same fused multi-pass kernel as our GPT (model/twopass.py, merged
by log-sum-exp, no L x L tensor), and with an ``AttnOptions`` passed as the forward keyword
``extrapolab_opts`` the same call takes a per-layer temperature and a logits sink that receives
every layer's tau = 1 logits one query block at a time (the reference path): Algorithm 1's
statistics from the model's own q and k without eager [H, L, L] probabilities (hf/temperature.py
``HFBlockTarget``). The settings live in ``config.extrapolab_rope`` (a plain dict).

A second forward keyword, ``extrapolab_layer_tau`` (:data:`CHOOSE_KWARG`), takes a callable
``choose(layer, q, k, q_pos, k_pos, scheme, window) -> tau``: each layer hands it the q, k its
logits come from (rotated, log-n applied, scaled, GQA heads repeated) and then attends at the tau
it returns, so a statistic read off one layer's logits can set that layer's temperature before the
next layer runs (Algorithm 1 in one forward, align/onepass.py).

A third, ``extrapolab_in_cache`` (:data:`STREAM_KWARG`), is E5's cached-window decoding (hf/cached.py,
StreamingLLM's cache of sink tokens and a window): the model is called at position 0, so the cache
holds keys before rotation, and each call rotates every cached key at its position in the cache and
the queries at theirs.

A module with learned attention sinks (gpt-oss's ``sinks``, one logit per query head) passes them to
``attend`` (``sinks=``), which carries them exactly on its paths (docs/attention.md, "Model options").

Causal language models only: the function is causal by position, and the registered mask function
(hf/masks.py) refuses a padding mask and any mask but causal, sliding-window and chunked, since the keys
are taken to be the positions that end at the last query (a full cache).
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from functools import lru_cache

import torch

from ..io import UserError
from ..model.attention import AttnOptions, attend
from ..positional.base import PositionalScheme, SchemeError
from ..positional.rope_twopass import FarRule, Passes, check_rule, selfextend_max_length, shift_by
from ..positional.rotary_dca import ChunkRule, check_chunk_rule
from ..positional.rotary_streaming import SinkRule, check_sink_rule
from ..positional.rotary import logn_scale
from . import geometry, masks

ATTN = "extrapolab"  #: the attn_implementation name registered with transformers
OPTS_KWARG = "extrapolab_opts"  #: forward keyword carrying an AttnOptions (temperature, logits sink)
CHOOSE_KWARG = "extrapolab_layer_tau"  #: forward keyword: a callable choosing each layer's tau (module doc)
STREAM_KWARG = "extrapolab_in_cache"  #: forward keyword: keys cached unrotated, placed by cache slot (hf/cached.py)
TWOPASS = ("selfextend", "rerope", "rerope-leaky", "dca", "streaming")  #: methods that run attention in several passes


class HFRope(PositionalScheme):
    """Positional hooks for a Hugging Face RoPE model whose q, k arrive rotated (module doc); one per layer
    geometry (hf/geometry.py: ``inv_freq`` empty for a NoPE layer, ``halves`` the pair layout) and soft-cap."""

    name = "hf-rope"
    kind = "rotary"
    paper = "Hugging Face RoPE; Self-Extend (Jin et al. 2024), ReRoPE (Su 2023), DCA (An et al. 2024), log-n"
    summary = "q, k rotated by the model; log-n factor on q; each pass's positions by re-rotation"

    def __init__(self, num_heads: int, rule: FarRule | ChunkRule | SinkRule | None = None,
                 inv_freq: torch.Tensor | None = None, logn_length: int | None = None, halves: bool = True,
                 softcap: float | None = None) -> None:
        super().__init__(num_heads)
        self.rule, self.inv_freq, self.logn_length, self.halves = rule, inv_freq, logn_length, halves
        self.softcap = float(softcap) if softcap else None
        if logn_length:
            self.relative = False
        if self.softcap:  # a score-level hook: the reference path, in blocks of query rows
            self.reference_only = f"logits soft-capped at {self.softcap:g} (transformers' softcap, Gemma 2)"

    def rotate(self, q, k, q_pos, k_pos):
        if self.logn_length:
            q = q * logn_scale(q_pos, self.logn_length).to(q.dtype)[:, None]  # [Lq, 1] per-query factor
        return q, k

    def scores(self, logits, block):
        """Gemma 2's soft-cap (transformers' eager ``softcap``): l -> tanh(l / c)·c on the scaled logits, before
        the mask (masked entries stay -inf)."""
        c = self.softcap
        return torch.where(torch.isfinite(logits), torch.tanh(logits / c) * c, logits)  # [B, H, bq, bk]

    def second_pass(self):
        if self.rule is None:
            return None
        return Passes(self.rule.passes(), self._shift, getattr(self.rule, "complete", True))

    def _shift(self, x, delta):
        return shift_by(x, delta, self.inv_freq, halves=self.halves)


@lru_cache(maxsize=256)
def _scheme(key: str, heads: int) -> HFRope:
    spec = json.loads(key)
    rule = None
    if spec.get("method") == "dca":
        rule = ChunkRule(int(spec["chunk"]), int(spec["w"]))
    elif spec.get("method") == "streaming":
        rule = SinkRule(int(spec["sinks"]), int(spec["w"]))
    elif spec.get("method"):
        rule = FarRule(spec["method"], int(spec["w"]), int(spec.get("G", 1)), float(spec.get("k", 1.0)))
    rot = spec.get("rotation")  # hf/geometry.py: {"inv_freq", "halves"}, None for a NoPE layer
    inv = torch.tensor(rot["inv_freq"] if rot else [], dtype=torch.float64) if "rotation" in spec else None
    if rule is not None and not rot and getattr(rule, "complete", True):
        rule = None  # a NoPE layer: passes that only move positions change nothing (StreamingLLM's keys still do)
    return HFRope(heads, rule, inv, spec.get("logn"), bool(rot["halves"]) if rot else True, spec.get("softcap"))


def scheme_for(config, heads: int, layer: int = 0, softcap: float | None = None) -> HFRope:
    """The :class:`HFRope` of layer ``layer`` under ``config.extrapolab_rope`` (plain attention when it has
    none), its rotation from the measured ``rotations`` (hf/geometry.py) and transformers' ``softcap``."""
    spec = dict(getattr(config, "extrapolab_rope", None) or {})
    rotations = spec.pop("rotations", None)
    if rotations is not None:
        spec["rotation"] = rotations.get(str(layer), rotations.get("0") if len(rotations) == 1 else None)
    if softcap:
        spec["softcap"] = float(softcap)
    return _scheme(json.dumps(spec, sort_keys=True), int(heads))


def _positions(position_ids, Lq: int, Lk: int, device):
    """(q_pos [Lq], k_pos [Lk]): the queries' positions, and the Lk keys ending at the last query."""
    if position_ids is None:
        q_pos = torch.arange(Lk - Lq, Lk, device=device)
    else:
        p = position_ids.reshape(-1, position_ids.shape[-1])  # [B|1, Lq]
        if p.shape[0] > 1 and not bool((p == p[:1]).all()):
            raise UserError("the extrapolab attention takes one position row for the whole batch; score "
                            "sequences without padding or packing")
        q_pos = p[0].to(device)
    end = int(q_pos[-1]) + 1 if Lq else Lk
    return q_pos, torch.arange(end - Lk, end, device=device)


def _in_cache(scheme: HFRope, query, key):
    """E5 with a cache of keys before rotation (:data:`STREAM_KWARG`, hf/cached.py): q, k were rotated at
    position 0 (a no-op), so rotate them at their positions in the cache, keys 0..Lk-1 and the queries
    the last Lq of them -> (query, key, q_pos, k_pos)."""
    Lq, Lk = query.shape[2], key.shape[2]
    k_pos = torch.arange(Lk, device=query.device)  # [Lk]
    q_pos = k_pos[Lk - Lq:]
    return (shift_by(query, q_pos.to(torch.float64), scheme.inv_freq, halves=scheme.halves),
            shift_by(key, k_pos.to(torch.float64), scheme.inv_freq, halves=scheme.halves), q_pos, k_pos)


def _one(query, key, value, q_pos, k_pos, scheme, layer, opts, extra, choose):
    """Attention of q [B,H,Lq,D] over k, v [B,H,Lk,D] at these positions -> [B, H, Lq, D]."""
    if choose is not None:  # rotate (log-n) once, let the chooser read these q, k, attend at its tau
        query, key = scheme.rotate(query, key, q_pos, k_pos)
        tau = float(choose(layer, query, key, q_pos, k_pos, scheme, opts.window))
        return attend(query, key, value, q_pos, k_pos, scheme, layer, replace(opts, temperature=tau), rotate=False,
                      **extra)[0]
    return attend(query, key, value, q_pos, k_pos, scheme, layer, opts, **extra)[0]


def extend_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention function: q [B,H,Lq,D], k/v [B,Hkv,Lk,D] -> ([B,Lq,H,D], None)."""
    B, H, Lq, D = query.shape
    probe = kwargs.get(geometry.PROBE_KWARG)
    if probe is not None:  # hf/geometry.py: the q, k the model rotated, before anything of ours
        probe.append((getattr(module, "layer_idx", None), query.detach().clone(), key.detach().clone()))
    layer = int(getattr(module, "layer_idx", 0) or 0)
    scheme = scheme_for(getattr(module, "config", None), H, layer, kwargs.get("softcap"))
    opts = kwargs.get(OPTS_KWARG) or AttnOptions()
    chunk = masks.layer_chunks(attention_mask)  # Llama 4's chunked layers (hf/masks.py), else None
    choose = kwargs.get(CHOOSE_KWARG)
    if chunk is not None and (choose is not None or opts.logits_sink is not None):
        raise UserError(f"temperature alignment reads each layer's logits over every key up to the query, but layer "
                        f"{layer} attends within chunks of {chunk.size} tokens (attention_chunk_size); align a "
                        "model without chunked attention")
    if kwargs.get(STREAM_KWARG):
        query, key, q_pos, k_pos = _in_cache(scheme, query, key)
    else:
        q_pos, k_pos = _positions(kwargs.get("position_ids"), Lq, key.shape[2], query.device)
    rep = H // key.shape[1]
    if rep > 1:  # grouped-query attention: each key/value head serves rep query heads
        key = key[:, :, None].expand(-1, -1, rep, -1, -1).flatten(1, 2)  # [B, H, Lk, D]
        value = value[:, :, None].expand(-1, -1, rep, -1, -1).flatten(1, 2)
    c = 1.0 if scaling is None else float(scaling) * math.sqrt(D)  # attend scales by 1/sqrt(D)
    if not math.isclose(c, 1.0, rel_tol=1e-12, abs_tol=0.0):
        query = query * c
    window = kwargs.get("sliding_window")
    if window:  # Hugging Face's sliding window: keys at distance < window, as AttnOptions.window
        opts = replace(opts, window=int(window))
    sinks = getattr(module, "sinks", None)  # gpt-oss: a learned sink logit per query head (docs/attention.md)
    extra = {} if sinks is None else {"sinks": sinks}
    if chunk is None:
        out = _one(query, key, value, q_pos, k_pos, scheme, layer, opts, extra, choose)
    else:  # each chunk's queries over that chunk's keys: exactly the chunked mask (hf/masks.py)
        out = torch.cat([_one(query[:, :, a:b], key[:, :, c0:c1], value[:, :, c0:c1], q_pos[a:b], k_pos[c0:c1],
                              scheme, layer, opts, extra, None)
                         for a, b, c0, c1 in masks.chunk_spans(Lq, key.shape[2], chunk)], dim=2)  # [B, H, Lq, D]
    return out.transpose(1, 2).contiguous(), None  # [B, Lq, H, D]


def register() -> str:
    """Register ``ATTN`` with transformers' attention and mask registries (idempotent); its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN, extend_attention)
    AttentionMaskInterface.register(ATTN, masks.model_mask)
    return ATTN


def install(model, method: str | None, params: dict, logn: int | None, train_length: int) -> dict:
    """Write the extension into ``model.config.extrapolab_rope``; returns what the run records
    (method and its settings, Self-Extend's maximum length, log-n's L_tr)."""
    spec: dict = {}
    record: dict = {}
    if method:
        try:
            if method == "dca":
                rule = check_chunk_rule(params["chunk"], params.get("w"), train_length, label="--rope dca")
            elif method == "streaming":
                rule = check_sink_rule(params["sinks"], params.get("w"), train_length, label="--rope streaming")
            else:
                rule = check_rule(method, params["w"], train_length, int(params.get("G", 1)),
                                  float(params.get("k", 1.0)), label=f"--rope {method}")
        except SchemeError as e:
            raise UserError(str(e)) from None
        rotations = geometry.measure(model, geometry.far_position(model.config, train_length))
        spec.update(rule.describe(), rotations=rotations)
        record.update(rule.describe())
        if method == "selfextend":
            record["max_length"] = selfextend_max_length(train_length, rule.window, rule.group)
    else:
        geometry.check_called(model)  # log-n alone: nothing to re-rotate, but it must run
    if logn:
        spec["logn"] = record["logn"] = int(logn)
    model.config.extrapolab_rope = spec
    return record
