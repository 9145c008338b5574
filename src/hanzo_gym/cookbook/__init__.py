"""The parts of tinker-cookbook that Tinker's own examples import, so that they run with only their imports
changed: `from hanzo_gym.cookbook import model_info, renderers` for `from tinker_cookbook import …`."""

from hanzo_gym.cookbook import model_info, renderers, tokenizer_utils

__all__ = ["model_info", "renderers", "tokenizer_utils"]
