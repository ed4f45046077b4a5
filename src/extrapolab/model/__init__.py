from .attention import AttnOptions, attend
from .gpt import GPT, KVCache, ModelConfig, build_scheme
from .regular_lm import RegularLM, build_model

__all__ = ["AttnOptions", "attend", "GPT", "KVCache", "ModelConfig", "RegularLM", "build_model", "build_scheme"]
