"""FIRE (Li et al. 2024) as the reproduction in chuanyang-Zheng/DAPE (``DAPE.py`` class FIRE) computes it,
written here with a scheme's parameters: the independent reference of test_fire.py and test_fire_flex.py."""
import math

import torch
import torch.nn.functional as F

from extrapolab import positional


def official_fire(s, layer, L, init_L):
    """DAPE.py's FIRE.forward on an [L, L] score map, its nn.Sequential MLP written with s's parameters of
    ``layer`` (so gradients reach them): returns the [H, L, L] bias it adds (before the causal mask)."""
    g = 0 if s.shared else layer

    def mlp(x):  # nn.Linear(1, width) -> nn.ReLU() -> nn.Linear(width, H)
        return F.linear(F.relu(F.linear(x, s.w1[g][:, None], s.b1[g])), s.w2[g], s.b2[g])

    c, L_multiplier, eps = s.c[g], s.L_mult[g], 1e-6
    rel_distance = torch.tril(torch.arange(L).view(L, 1).repeat(1, L) + torch.arange(0, -L, -1)).to(c.dtype)
    threshold = torch.abs(L_multiplier * init_L)
    rel_distance_max = torch.max(torch.tril(rel_distance), dim=-1)[0]
    pos_normalizer = torch.max(rel_distance_max, threshold)[:, None]
    rel_distance = torch.log(torch.abs(c * rel_distance) + 1)
    pos_normalizer = torch.log(torch.abs(c * pos_normalizer) + 1) + eps
    return mlp((rel_distance / pos_normalizer).unsqueeze(-1)).permute(2, 0, 1)  # [H, L, L]


def fire(H=3, layers=2, L_tr=20, shared=False, L_mult=1.37, seed=0):
    torch.manual_seed(seed)
    s = positional.build("fire", H, layers=layers, original_length=L_tr, shared=shared).double()
    with torch.no_grad():
        s.L_mult.fill_(L_mult)  # L = 27.4: never a position, so max(L, i) has no tie
        s.c.uniform_(0.05, 0.3)
    return s


def dense(q, k, v, q_pos, k_pos, s, layer, window=None, tau=1.0):
    """softmax((q·k/sqrt(d) + b_FIRE(i, j)) / tau) v, masked causally (and by the window), from the reproduction
    (the temperature divides the whole logit)."""
    top = int(max(q_pos.max(), k_pos.max())) + 1
    full = official_fire(s, layer, top, s.original_length)  # [H, top, top] by absolute position
    b = full[:, q_pos][:, :, k_pos]
    dist = q_pos[:, None] - k_pos[None]
    bad = (dist < 0) if window is None else (dist < 0) | (dist >= window)
    lg = ((q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + b) / tau).masked_fill(bad, -math.inf)
    return torch.softmax(lg, -1) @ v
