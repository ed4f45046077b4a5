"""Positional schemes (docs/architecture.md) behind one interface, and their registry.

Adding a scheme = one file in this package + one import line below.
"""
from .base import PositionalScheme, RelativeBias, SchemeError, ScoreBlock, causal_distance
from .registry import REGISTRY, build, names, register, register_callable, scheme_params

from . import none  # noqa: F401
from . import sinusoidal  # noqa: F401
from . import learned  # noqa: F401
from . import rotary  # noqa: F401
from . import rotary_pi  # noqa: F401  RoPE context extension: position interpolation
from . import rotary_ntk  # noqa: F401  NTK-aware base
from . import rotary_dynamic  # noqa: F401  dynamic NTK
from . import rotary_yarn  # noqa: F401  YaRN
from . import rotary_llama3  # noqa: F401  Llama 3.1's wavelength-band scaling
from . import rotary_longrope  # noqa: F401  LongRoPE / Phi-3: short and long factor sets
from . import rotary_proportional  # noqa: F401  p-RoPE / Gemma 4 "proportional": NoPE on the lowest frequencies
from . import xpos  # noqa: F401  rotary with a per-pair exponential decay (Sun et al. 2023)
from . import rotary_selfextend  # noqa: F401  Self-Extend (two passes)
from . import rotary_rerope  # noqa: F401  ReRoPE (two passes)
from . import rotary_rerope_leaky  # noqa: F401  leaky ReRoPE (two passes)
from . import rotary_dca  # noqa: F401  dual chunk attention (three passes)
from . import rotary_streaming  # noqa: F401  StreamingLLM: attention sinks + window (two passes, the rest unseen)
from . import t5  # noqa: F401
from . import alibi  # noqa: F401
from . import windowed  # noqa: F401
from . import kerple  # noqa: F401  3-para-log, bias+wht
from . import kerple_gauss  # noqa: F401  Gaussian-like kernels
from . import sandwich  # noqa: F401
from . import smoothed_sandwich  # noqa: F401
from . import qin  # noqa: F401
from . import sliding_dilated  # noqa: F401
from . import custom  # noqa: F401
from . import fox  # noqa: F401  positions from content: the Forgetting Transformer's gate
from . import headscale  # noqa: F401  NoPE with a learned temperature per head
from . import llama4_temperature  # noqa: F401  NoPE with Llama 4's per-query temperature (iRoPE's global layers)
from . import hybrid  # noqa: F401  a scheme per layer: RoPE/NoPE hybrids
from . import cope  # noqa: F401  score-level hook: contextual positions
from . import fire  # noqa: F401  learned functional bias, progressive interpolation
from . import stickbreaking  # noqa: F401  normalize hook: stick-breaking weights instead of softmax
from . import dape  # noqa: F401  score hook: an MLP (V2: a convolution) of every head's score and bias
from . import pope  # noqa: F401  polar coordinates: magnitudes from content, phases from position
from . import selective  # noqa: F401  accumulate hook: tokens mask earlier tokens for later queries

__all__ = [
    "PositionalScheme", "RelativeBias", "SchemeError", "ScoreBlock", "causal_distance",
    "REGISTRY", "build", "names", "register", "register_callable", "scheme_params",
]
