"""Models of the training package."""

from .gpt import CONFIGS, GPT, GPTConfig, GPTStage, get_config, lm_loss

__all__ = ["CONFIGS", "GPT", "GPTConfig", "GPTStage", "get_config", "lm_loss"]
