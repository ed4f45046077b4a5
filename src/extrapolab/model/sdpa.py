"""Fused SDPA with an additive mask: the one way the model's paths call it (docs/attention.md, "Masks").

Two bugs of PyTorch's cuDNN attention backend on the H100 affect a call with a mask: a float mask whose dtype
differs from q's (an fp32 bias under bf16 autocast) is silently read as q's dtype, giving wrong outputs
(pytorch/pytorch#191612), and grad_q is NaN when a mask is present and the length is 64 mod 128 (a regression
since 2.11, pytorch/pytorch#196678). So :func:`sdpa` casts a float mask to q's dtype, and on CUDA runs a masked
call with the cuDNN backend left out (:data:`MASKED_BACKENDS`: memory-efficient, flash, math -- the
memory-efficient kernel takes any float mask and returns its gradient for learnable biases). Calls without a
mask keep every backend.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from ..io import UserError


def masked_backends() -> list:
    """The SDPA backends a masked CUDA call may use: all but cuDNN."""
    from torch.nn.attention import SDPBackend

    return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def preferring_cudnn(fn):
    """``fn`` with SDPA's cuDNN backend first in line during its calls (its other backends kept, in SDPA's order):
    the bench's ``SCHEME+cudnn`` rows, an A/B of cuDNN's attention beside the flash kernel SDPA picks by default.
    Masked calls still leave cuDNN out (:func:`sdpa`); where cuDNN refuses a call, SDPA takes the next backend.
    Needs ``sdpa_kernel(..., set_priority=True)`` (torch 2.6 and later; a one-line error before)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if "set_priority" not in inspect.signature(sdpa_kernel).parameters:
        raise UserError(f"cuDNN-first SDPA needs torch >= 2.6 (sdpa_kernel's set_priority); this is torch "
                        f"{torch.__version__}: drop the +cudnn rows")

    @functools.wraps(fn)
    def run(*args, **kwargs):
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
        with sdpa_kernel(order, set_priority=True):
            return fn(*args, **kwargs)
    return run


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)`` with a float mask in q's dtype and, on CUDA
    with a mask, without the cuDNN backend (module doc). q [B, H, Lq, D], mask broadcastable to [B, H, Lq, Lk]."""
    if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    if mask is None or q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(masked_backends()):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
