"""GPT models (GPT-2 and Llama flavours) built only from megalite layers, and HF interop.

Names load lazily (PEP 562): `megalite.model.config` (GPTConfig, presets) is pure Python, and
the planner imports it without loading torch.
"""
from megalite._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "megalite.model.config": ["GPTConfig", "PRESETS", "preset"],
    "megalite.model.gpt": ["GPTModel"],
    "megalite.model.hf": ["config_from_hf", "from_hf", "to_hf"],
})
