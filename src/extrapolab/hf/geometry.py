"""Which layers of a Hugging Face model rotate q and k, in which pair layout and at which frequencies:
measured on the model, not listed per family.

The multi-pass methods re-rotate the q and k a layer's attention function receives (hf/extend.py), and E5's
cache rotates keys cached before rotation (hf/cached.py); both need, per layer, the frequencies and the pairs
the model rotated. Llama, Gemma, SmolLM3 and gpt-oss pair dimension i with i + d/2 (``rotate_half``); Cohere2
and Llama 4 pair 2i with 2i + 1 (Llama 4 in complex form); Gemma 3's sliding and full layers read different
frequencies; Llama 4's and SmolLM3's NoPE layers (``no_rope_layers``) and Cohere2's full layers do not rotate.
:func:`measure` runs the model on one token at positions 0, 1 and P, with the registered attention function
recording each layer's q and k (:data:`PROBE_KWARG`). With one token every layer's input is the same at every
position (attention over one key returns its value, whatever the rotation), so a RoPE layer has q(p) =
R(p·θ) q(0) and a NoPE layer q(p) = q(0). For each layer it keeps the pair layout and the frequencies, among
the model's rotary buffers, that predict q and k at 1 and at P from position 0 (within :data:`TOL`), and
refuses the model in one line when none do (a rotation of other dimensions, or a position entering some
other way). P is below every length at which the model's RoPE changes its frequencies (dynamic NTK,
LongRoPE's long factors), so the ones measured are those a fixed-frequency method reads.
"""
from __future__ import annotations

import torch

from ..io import UserError
from ..positional.rope_twopass import rotate_by

PROBE_KWARG = "extrapolab_probe"  #: forward keyword: a list the attention function appends (layer, q, k) to
TOL = 0.05  #: relative error of a predicted q, k accepted (bf16 rounding ~4e-3; a wrong layout or base ~1)
STILL = 1e-4  #: relative change below which a layer does not rotate


def far_position(config, train_length: int | None) -> int:
    """P: below L_tr, any ``original_max_position_embeddings`` of the RoPE and 1,024 (module doc)."""
    rp = getattr(config, "rope_parameters", None) or {}
    blocks = [rp, *(v for v in rp.values() if isinstance(v, dict))] if isinstance(rp, dict) else []
    tops = [int(train_length or 1024), 1024, *(int(b["original_max_position_embeddings"]) for b in blocks
                                               if isinstance(b.get("original_max_position_embeddings"), int))]
    return max(2, min(tops) - 1)


def candidates(model) -> list[torch.Tensor]:
    """The distinct inverse frequencies of the model's rotary buffers (``inv_freq``, ``<type>_inv_freq``), float64."""
    out: list[torch.Tensor] = []
    for name, buf in model.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("inv_freq") and "original_" not in leaf:
            f = buf.detach().to(torch.float64).cpu()
            if not any(f.shape == g.shape and torch.equal(f, g) for g in out):
                out.append(f)
    return out


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@torch.no_grad()
def _fit(x0: tuple, moved: dict, cands: list, layer, model_type: str) -> dict | None:
    """{"inv_freq", "halves"} predicting ``moved`` {p: (q, k)} from ``x0`` = (q, k) at 0, or None (NoPE)."""
    if max(_err(a, b) for p in moved for a, b in zip(x0, moved[p])) < STILL:
        return None
    best = (float("inf"), None)
    for inv in cands:
        for halves in (True, False):
            e = max(_err(rotate_by(a, (p * inv)[None], halves), b) for p in moved for a, b in zip(x0, moved[p]))
            best = min(best, (e, (inv, halves)), key=lambda t: t[0])
    if best[0] < TOL:
        inv, halves = best[1]
        return {"inv_freq": inv.tolist(), "halves": halves}
    raise UserError(f"cannot tell how layer {layer} of this {model_type} model rotates q and k: none of its "
                    f"{len(cands)} rotary embeddings, in either pair layout, turns its q, k at position 0 into those "
                    f"at {', '.join(map(str, moved))} (best relative error {best[0]:.2g}); it cannot take a "
                    "multi-pass --rope method or --protocol cached")


@torch.no_grad()
def _record(model, positions) -> dict[int, list]:
    """{p: [(layer_idx, q, k) per attention call]} of one-token forwards at each position p (module doc); a
    one-line error when the registered attention function is never called."""
    cfg = model.config
    vocab = int(getattr(cfg, "vocab_size", 0) or model.get_input_embeddings().weight.shape[0])
    dev = next(model.parameters()).device
    ids = torch.tensor([[vocab // 3], [vocab // 2], [vocab - 1]], device=dev)  # [3, 1]: three tokens, one each
    runs, kept = {}, getattr(cfg, "extrapolab_rope", None)
    cfg.extrapolab_rope = {}  # plain attention while measuring: the model's own rotation, nothing of a method's
    try:
        for p in positions:
            runs[p] = rec = []
            model(input_ids=ids, position_ids=torch.full((1, 1), p, device=dev), use_cache=False,
                  **{PROBE_KWARG: rec})
    finally:
        if kept is None:
            del cfg.extrapolab_rope
        else:
            cfg.extrapolab_rope = kept
    for rec in runs.values():
        if not rec:
            raise UserError(f"this {cfg.model_type} model never calls the registered attention function (its "
                            "attention does not go through transformers' attention interface); it cannot take a "
                            "--rope method, logn or --protocol cached")
    return runs


def check_called(model) -> None:
    """A one-line error unless the model's attention runs through the registered function."""
    _record(model, (0,))


@torch.no_grad()
def measure(model, far: int) -> dict[str, dict | None]:
    """{str(layer): {"inv_freq": [...], "halves": bool} or None (NoPE)} of an HF model whose attention runs
    through the registered function (module doc); ``far`` = P (:func:`far_position`)."""
    cfg = model.config
    runs = _record(model, (0, 1, int(far)))
    layers = [layer for layer, _, _ in runs[0]]
    cands = candidates(model)
    fits = []
    for i, layer in enumerate(layers):
        x0 = tuple(t.double() for t in runs[0][i][1:])  # (q [3, H, 1, D], k [3, Hkv, 1, D])
        moved = {p: tuple(t.double() for t in runs[p][i][1:]) for p in (1, int(far))}
        fits.append(_fit(x0, moved, cands, i if layer is None else layer, cfg.model_type))
    if all(layer is not None for layer in layers) and len(set(layers)) == len(layers):
        return {str(layer): g for layer, g in zip(layers, fits)}
    if any(g != fits[0] for g in fits):  # the attention function tells layers apart by their layer_idx only
        raise UserError(f"the attention modules of this {cfg.model_type} model have no distinct layer_idx but "
                        "rotate differently; it cannot take a multi-pass --rope method or --protocol cached")
    return {"0": fits[0]}  # every layer alike (the attention function reads layer 0's)


def summary(rotations: dict) -> dict:
    """What the run record keeps: the rotating and NoPE layers and each layout's layers."""
    rope = [int(k) for k, g in rotations.items() if g]
    return {"rope_layers": rope, "nope_layers": [int(k) for k, g in rotations.items() if not g],
            "pairs": sorted({"(i, i + d/2)" if g["halves"] else "(2i, 2i + 1)" for g in rotations.values() if g})}
