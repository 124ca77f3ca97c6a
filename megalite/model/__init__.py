from megalite.model.config import GPTConfig, PRESETS, preset

__all__ = ["GPTConfig", "PRESETS", "preset"]
