"""Toeplitz fast path of :func:`.attention.attend` (docs/attention.md).

Applies to relative schemes at contiguous positions (multiplicative kernels too, see below): with the
queries in reverse order the bias b(m - n) depends on (row + column) only, so the 4-D mask is a
zero-copy ``as_strided`` view (strides 1, 1) of one O(H·L) "Hankel" vector built from the scheme's
distance table, once per forward and shared by every layer (:class:`.tables.DistanceBias`). No
L x L bias ever exists, so 64k-token evaluation costs O(H·L) bias memory. Learnable tables (KERPLE,
T5, sliding-dilated r) go through :class:`HankelSDPA`: fused flash forward with the detached mask
and a backward that recomputes P row-chunk by row-chunk in cache, skips masked key ranges and
returns the table gradient as anti-diagonal sums of dS = P ⊙ (dP − rowsum(dO ⊙ O)).
Multiplicative kernels (KERPLE wht) use the same Hankel views in a tiled online softmax
(:func:`tiled_softmax`), with the same chunked backward when anything needs a gradient.

Shapes: q [B,H,Lq,D], k/v [B,H,Lk,D]; distance tables [H|1, n]; Hankel vectors ext [H|1, X].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .reference import divide_finite
from .sdpa import sdpa
from .tables import DistanceBias

#: The fused CPU kernel that returns (out, logsumexp), which :class:`HankelSDPA` needs for its
#: backward. Private to torch: tests/test_attention_paths.py checks its schema, so a torch upgrade
#: that changes it fails loudly (without it, learnable tables fall back to a dense per-block mask).
CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Block and chunk sizes below were chosen by hand on the 2-core dev CPU (torch 2.13, AVX-512);
# no benchmark row records them, they only affect speed (every size is exact, see the tests).
TOEPLITZ_BLOCK = 512  # query rows per block on the Toeplitz path
WEIGHTED_TILE = (128, 512)  # (query rows, keys) per tile of the multiplicative-kernel path
CHUNK_ELEMS = 1 << 17  # HankelSDPA backward works on ~0.5 MB score chunks (fit in L2)
# torch.exp takes a ~30x slower path for arguments below -87.3 (results that underflow) and for
# -inf; shifted logits are clamped first: masked entries get e^-80 ~ 2e-35 instead of 0
EXP_FLOOR = -80.0


def hankel_view(ext: torch.Tensor, offset: int, rows: int, cols: int) -> torch.Tensor:
    """[1, H', rows, cols] zero-copy mask with mask[0, h, r, j] = ext[h, offset + r + j]."""
    if torch.compiler.is_compiling() and rows > 0 and cols > 0:  # the same view, traceable (no storage offset read)
        return ext.narrow(-1, offset, rows + cols - 1).unfold(-1, cols, 1).unsqueeze(0)
    return ext.as_strided((1, ext.shape[0], rows, cols), (0, ext.stride(0), 1, 1),
                          ext.storage_offset() + offset)


_PROBE: dict[str, bool] = {}


def hankel_ok(device: torch.device) -> bool:
    """Once per device type: does the fused SDPA kernel honour a stride-(1, 1) mask exactly?"""
    kind = device.type
    if kind not in _PROBE:
        # autocast off: the answer is cached for the process, and a probe under bf16 autocast (a bf16
        # evaluation that happens to call first) would miss fp32 tolerance and disable the fused path
        try:
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, 2, 6, 4, generator=g).to(device) for _ in range(3))
            m = hankel_view(torch.randn(2, 11, generator=g).to(device), 0, 6, 6)  # [1, 2, 6, 6]
            with torch.autocast(kind, enabled=False):
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
                ref = torch.softmax(q @ k.transpose(-1, -2) / 2.0 + m, dim=-1) @ v  # d_head = 4
            _PROBE[kind] = bool(torch.allclose(a, ref, atol=1e-5))
        except (RuntimeError, TypeError):
            _PROBE[kind] = False
    return _PROBE[kind]


def antidiag_sums(m: torch.Tensor) -> torch.Tensor:
    """m [H, R, C] -> [H, R+C-1]: out[h, x] = sum over u + w = x of m[h, u, w]."""
    H, R, C = m.shape
    pad = torch.cat([m, m.new_zeros(H, R, R)], dim=2)  # [H, R, C+R]: wrap-arounds read zeros
    view = pad.as_strided((H, R + C - 1, R), (pad.stride(0), 1, C + R - 1))  # [H, x, u]
    return view.sum(-1)


def tiled_softmax(q, k, v, ext, wext, off: int, scale: float, need_lse: bool = True):
    """softmax((q·k·scale)·w + b) v with w, b Hankel views of wext, ext at ``off``: q [B,H,R,D]
    (reversed rows), k/v [B,H,C,D]. Online softmax over key tiles of at most ~2·CHUNK_ELEMS
    scores, so the work stays in cache (flash-style). Returns (out [B,H,R,D], logsumexp [B,H,R])."""
    B, H, R, D = q.shape
    C, cols = k.shape[2], min(k.shape[2], WEIGHTED_TILE[1])
    nb = max(1, 2 * CHUNK_ELEMS // (H * R * cols))  # batch rows per tile
    out, lse = torch.empty_like(q), q.new_empty(B, H, R)
    if C <= cols and B <= nb:  # one tile (decoding, short blocks): plain max-shifted softmax
        s = torch.matmul(q * scale, k.transpose(-1, -2))  # [B, H, R, C]
        s.mul_(hankel_view(wext, off, R, C)).add_(hankel_view(ext, off, R, C))
        if not need_lse:
            return torch.matmul(torch.softmax(s, dim=-1), v), None
        mx = s.amax(-1, keepdim=True)
        mx = mx.masked_fill(mx == -math.inf, 0.0)  # rows with no visible key
        p = s.sub_(mx).clamp_(min=EXP_FLOOR).exp_()
        den = p.sum(-1, keepdim=True)
        return torch.matmul(p, v) / den, (mx + den.log()).squeeze(-1)
    for b0 in range(0, B, nb):
        b1 = min(B, b0 + nb)
        qs = q[b0:b1] * scale  # [b, H, R, D]
        mx = q.new_full((b1 - b0, H, R, 1), -math.inf)  # running max
        den = q.new_zeros(b1 - b0, H, R, 1)  # running softmax denominator
        acc = q.new_zeros(b1 - b0, H, R, D)  # running numerator
        for j0 in range(0, C, cols):
            j1 = min(C, j0 + cols)
            s = torch.matmul(qs, k[b0:b1, :, j0:j1].transpose(-1, -2))  # [b, H, R, c]
            s.mul_(hankel_view(wext, off + j0, R, j1 - j0)).add_(hankel_view(ext, off + j0, R, j1 - j0))
            new = torch.maximum(mx, s.amax(-1, keepdim=True))
            safe = new.masked_fill(new == -math.inf, 0.0)  # rows that saw no key yet
            p = s.sub_(safe).clamp_(min=EXP_FLOOR).exp_()
            corr = (mx - safe).exp_()
            den.mul_(corr).add_(p.sum(-1, keepdim=True))
            acc.mul_(corr).add_(torch.matmul(p, v[b0:b1, :, j0:j1]))
            mx = new
        out[b0:b1] = acc / den
        lse[b0:b1] = (mx + den.log()).squeeze(-1)
    return out, lse


class HankelSDPA(torch.autograd.Function):
    """Attention whose Hankel-view mask vector ``ext`` (and multiplicative kernel ``wext``, KERPLE
    wht) may need gradients: scores (q·k·scale)[·w] + b with b[r, j] = ext[off + r + j].

    q [B,H,R,D] (rows in reversed order), k/v [B,H,C,D], ext/wext [H, X]; ext[x] is finite only
    for lo_x <= x <= hi_x (the rest -inf, gradient 0). Forward: the fused flash kernel with the
    detached mask (or :func:`tiled_softmax` with a kernel). Backward: P recomputed chunk by chunk
    from the saved logsumexp; table gradients are anti-diagonal sums of dS (and of dS ⊙ q·k·scale).
    """

    @staticmethod
    def forward(ctx, q, k, v, ext, wext, off, lo_x, hi_x, scale):
        if wext is None:
            mask = hankel_view(ext.detach(), off, q.shape[2], k.shape[2])  # [1, H, R, C]
            out, lse = CPU_FLASH(q, k, v, 0.0, False, attn_mask=mask, scale=scale)  # [B,H,R,D], [B,H,R]
        else:
            out, lse = tiled_softmax(q, k, v, ext.detach(), wext.detach(), off, scale)
        ctx.save_for_backward(q, k, v, ext, wext, out, lse)
        ctx.geom = (off, lo_x, hi_x, scale)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, ext, wext, out, lse = ctx.saved_tensors
        off, lo_x, hi_x, scale = ctx.geom
        B, H, R, D = q.shape
        C = k.shape[2]
        extd = ext.detach()
        wd = None if wext is None else wext.detach()
        g = g.contiguous()
        di = (g * out).sum(-1, keepdim=True)  # [B, H, R, 1] = rowsum(dP ⊙ P)
        lse = lse.unsqueeze(-1)  # [B, H, R, 1]
        qs, ks = q * scale, k * scale  # [B, H, R|C, D]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        gext = torch.zeros_like(extd)  # [H, X]
        gw = None if wd is None else torch.zeros_like(wd)
        rows = max(8, min(R, CHUNK_ELEMS // max(1, H * C)))
        for r0 in range(0, R, rows):
            r1 = min(R, r0 + rows)
            j0, j1 = max(0, lo_x - off - (r1 - 1)), min(C, hi_x - off - r0 + 1)  # visible keys
            if j1 <= j0:
                continue
            nb = max(1, CHUNK_ELEMS // (H * (r1 - r0) * (j1 - j0)))
            kc, vc = k[:, :, j0:j1], v[:, :, j0:j1]  # [B, H, c, D]
            m = hankel_view(extd, off + r0 + j0, r1 - r0, j1 - j0)  # [1, H, r, c]
            w = None if wd is None else hankel_view(wd, off + r0 + j0, r1 - r0, j1 - j0)
            acc = q.new_zeros(H, r1 - r0, j1 - j0)  # dS summed over the batch
            accw = None if w is None else torch.zeros_like(acc)  # (dS ⊙ q·k·scale) summed
            for b0 in range(0, B, nb):
                b1 = min(B, b0 + nb)
                raw = torch.matmul(qs[b0:b1, :, r0:r1], kc[b0:b1].transpose(-1, -2))  # [b,H,r,c]
                s = raw.add_(m) if w is None else (raw * w).add_(m)  # logits
                p = s.sub_(lse[b0:b1, :, r0:r1]).clamp_(min=EXP_FLOOR).exp_()  # P
                gc = g[b0:b1, :, r0:r1]  # [b, H, r, D]
                ds = torch.matmul(gc, vc[b0:b1].transpose(-1, -2)).sub_(di[b0:b1, :, r0:r1]).mul_(p)
                acc += ds[0] if b1 - b0 == 1 else ds.sum(0)
                if w is not None:
                    raw.mul_(ds)  # dS ⊙ q·k·scale: the kernel's gradient
                    accw += raw[0] if b1 - b0 == 1 else raw.sum(0)
                    ds = ds.mul_(w)  # dS ⊙ w drives dq, dk
                dq[b0:b1, :, r0:r1] = torch.matmul(ds, ks[b0:b1, :, j0:j1])
                dk[b0:b1, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), qs[b0:b1, :, r0:r1])
                dv[b0:b1, :, j0:j1] += torch.matmul(p.transpose(-1, -2), gc)
            x0, x1 = off + r0 + j0, off + r0 + j0 + (r1 - r0) + (j1 - j0) - 1
            gext[:, x0:x1] += antidiag_sums(acc)
            if gw is not None:
                gw[:, x0:x1] += antidiag_sums(accw)
        return dq, dk, dv, gext, gw, None, None, None, None


def toeplitz_attention(q, k, v, a: int, c: int, db: DistanceBias, layer: int, *, scale: float,
                       tau: float = 1.0, window: int | None = None, block: int | None = None,
                       tau_h: torch.Tensor | None = None):
    """q [B,H,Lq,D] at positions a.., k/v [B,H,Lk,D] at c..; c <= a. Returns [B,H,Lq,D].

    ``scale`` multiplies q·k and already carries 1/tau; the bias table is divided by ``tau`` here.
    ``tau_h`` [H|1]: a further per-head temperature (the scheme's), dividing q and the table per
    head, so the structure stays Toeplitz. ``block``: query rows per fused call (None: one call;
    the wht path always tiles)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    dmax = a + Lq - 1 - c  # largest distance (last query, first key)
    weighted = db.scheme.has_weight
    if tau_h is not None:
        q = q / tau_h.view(1, -1, 1, 1).to(q.dtype)  # [B, H, Lq, D]: q·k / tau_h
    if not db.scheme.has_bias and not weighted and window is None and c + Lk - 1 <= a:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)  # every key visible
    ext, dfin = db.hankel(layer, dmax, Lq + Lk - 1, window, tau, q.dtype)  # [H', Lq+Lk-1]
    if tau_h is not None:
        ext = divide_finite(ext, tau_h.view(-1, 1).to(ext.dtype))  # [H, Lq+Lk-1]: b / tau_h (-inf stays -inf)
    wext = db.hankel(layer, dmax, Lq + Lk - 1, dtype=q.dtype, kind="weight")[0] if weighted else None
    if weighted:  # manual tiles: autograd when anything needs a gradient
        learn = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, ext, wext))
        fused, bs = True, WEIGHTED_TILE[0]
    else:
        learn = ext.requires_grad and torch.is_grad_enabled()
        fused = q.device.type == "cpu" and hankel_ok(q.device) and (not learn or CPU_FLASH is not None)
        bs = max(1, int(block)) if block else Lq
    qf = q.flip(2) if Lq > 1 else q  # reversed queries: row r is query Lq-1-r
    outs = []
    for r0 in range(0, Lq, bs):
        r1 = min(Lq, r0 + bs)
        hi = min(Lk, dmax - r0 + 1)  # keys after the block's last query are all masked
        lo = min(hi - 1, max(0, dmax - (r1 - 1) - dfin))  # keys beyond every finite distance
        qb, kb, vb = qf[:, :, r0:r1], k[:, :, lo:hi], v[:, :, lo:hi]
        if learn and fused:
            o = HankelSDPA.apply(qb, kb, vb, ext, wext, r0 + lo, dmax - dfin, dmax, scale)
        elif weighted:
            o = tiled_softmax(qb, kb, vb, ext, wext, r0 + lo, scale, need_lse=False)[0]
        else:
            m = hankel_view(ext, r0 + lo, r1 - r0, hi - lo)  # [1, H', bq, bk]
            o = sdpa(qb, kb, vb, m if fused else m.contiguous(),
                                               scale=scale)
        outs.append(o)  # [B, H, bq, D]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.flip(2) if Lq > 1 else out
