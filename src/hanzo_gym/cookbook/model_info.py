"""`tinker_cookbook.model_info`: which renderer a model was trained with.

Models in Tinker's table get Tinker's answer. Any other model (a local folder, a .gguf file, a hub id Tinker
does not serve) whose tokenizer carries a chat template gets `chat_template`, the renderer that renders with
that template; without a template there is no safe default and the error says so.
"""

from transformers import PreTrainedTokenizerBase

from hanzo_gym.renderers import RendererError
from hanzo_gym.renderers.recommended import recommended_renderer_name, recommended_renderer_names


def get_recommended_renderer_names(model_name: str) -> list[str]:
    try:
        return list(recommended_renderer_names(model_name))
    except RendererError:
        return [get_recommended_renderer_name(model_name)]


def get_recommended_renderer_name(model_name: str, tokenizer: PreTrainedTokenizerBase | None = None) -> str:
    """`tokenizer`, when given, saves loading the model's tokenizer again for the chat-template check."""
    try:
        return recommended_renderer_name(model_name)
    except RendererError as unknown:
        from hanzo_gym.model.hub import load_tokenizer
        from hanzo_gym.renderers.jinja import tokenizer_template

        if tokenizer_template(tokenizer or load_tokenizer(model_name)) is None:
            raise unknown from None
        return "chat_template"
