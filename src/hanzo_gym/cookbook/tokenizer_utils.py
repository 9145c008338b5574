"""`tinker_cookbook.tokenizer_utils.get_tokenizer`: a model's tokenizer from a hub id, folder or .gguf file."""

from transformers import PreTrainedTokenizerBase

from hanzo_gym.model.hub import load_tokenizer


def get_tokenizer(model_name: str) -> PreTrainedTokenizerBase:
    return load_tokenizer(model_name)
