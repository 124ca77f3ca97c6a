"""GPT models (GPT-2 and Llama flavours) built only from megalite layers, and HF interop."""
from megalite.model.config import PRESETS, GPTConfig, preset
from megalite.model.gpt import GPTModel
from megalite.model.hf import config_from_hf, from_hf

__all__ = ["GPTConfig", "PRESETS", "preset", "GPTModel", "from_hf", "config_from_hf"]
