from .attention import AttnOptions, attend
from .cache import KVCache
from .gpt import GPT, ModelConfig, build_scheme
from .regular_lm import RegularLM, build_model

__all__ = ["AttnOptions", "attend", "GPT", "KVCache", "ModelConfig", "RegularLM", "build_model", "build_scheme"]
