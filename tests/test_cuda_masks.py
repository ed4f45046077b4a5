"""Masked fused SDPA on CUDA at lengths that are 64 mod 128 (gpu): on the H100 with torch 2.11 cuDNN's
attention returns NaN grad_q when a mask is present at such lengths (pytorch/pytorch#196678), and reads a float
mask of another dtype than q as q's (pytorch/pytorch#191612). Every masked path (Toeplitz blocks, the fallback's
dense blocks, the folded path's windows, the split path) in bf16 and fp32: finite gradients equal to the plain
path's (model/sdpa.py leaves cuDNN out of masked calls and casts the mask)."""
import pytest
import torch

from extrapolab.model.attention import AttnOptions
from extrapolab.model.gpt import GPT, ModelConfig

pytestmark = pytest.mark.gpu

CASES = [("alibi", "sdpa", {}), ("kerple-log", "sdpa", {}), ("t5", "blocked", {}), ("alibi", "auto", {"window": 40}),
         ("fox", "auto", {"window": 40}), ("fire", "sdpa", {}), ("qin-type1", "sdpa", {})]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,impl,kw", CASES)
def test_masked_paths_at_64_mod_128_have_finite_gradients_equal_to_plain(name, impl, kw, dtype):
    torch.manual_seed(0)
    m = GPT(ModelConfig(scheme=name, vocab_size=64, dim=256, heads=4, layers=2, train_length=128)).cuda()
    for L in (192, 320):  # both 64 mod 128; FIRE: beyond L_tr = 128, so the split path too
        idx = torch.randint(0, 64, (2, L), device="cuda")
        grads = {}
        for which, opts, dt in (("fast", AttnOptions(impl=impl, **kw), dtype),
                                ("plain", AttnOptions(impl="plain", **kw), torch.float32)):
            m.zero_grad()
            with torch.autocast("cuda", dtype=dt, enabled=dt != torch.float32):
                out = m(idx, opts=opts)
            out.float().square().mean().backward()
            grads[which] = torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None])
        assert torch.isfinite(grads["fast"]).all(), (name, L, dtype)
        err = float((grads["fast"] - grads["plain"]).norm() / grads["plain"].norm())
        assert err < (1e-4 if dtype == torch.float32 else 5e-2), (name, impl, L, dtype, err)
