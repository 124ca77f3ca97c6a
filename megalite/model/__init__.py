"""GPT models (GPT-2 and Llama flavours) built only from megalite layers, and HF interop.

Names load lazily (PEP 562). GPTConfig and the presets live in `megalite.config.model` (pure Python,
what the planner imports without loading torch); they are re-exported here.
"""
from megalite._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "megalite.config.model": ["GPTConfig", "PRESETS", "preset"],
    "megalite.model.gpt": ["GPTModel"],
    "megalite.model.hf": ["config_from_hf", "from_hf", "to_hf"],
})
