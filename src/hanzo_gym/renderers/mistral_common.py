"""Chats written by mistral-common, Mistral's own tokenizer library (`tokenizer_use_mistral_common`, Axolotl's key).

Mistral's tokenizers (tekken.json, tokenizer.model.v*) carry no Jinja template: mistral-common encodes a chat
request to tokens itself, control tokens included (`[INST]`, `[/INST]`, `[SYSTEM_PROMPT]`, …), so there is no text
to tokenize. The tokens are exactly `encode_chat_completion`'s; the spans of the messages are measured as the Jinja
renderer measures them, by swapping one message's content for a dummy (renderers/jinja.py), on tokens. An assistant
turn ends with eos, trained with it (`train_on_eos`). A system message is no turn of its own here: older tokenizer
versions write it into the last user turn, newer ones at the start, and either way its tokens are prompt.

Requests are encoded without mistral-common's rule on the last message (its `agnostic` mode): a training
conversation ends with the assistant's answer, a generation prompt with the user's question.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hanzo_gym.renderers.base import Message, Renderer, RendererError
from hanzo_gym.renderers.jinja import JinjaRenderer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

KEPT_KEYS = ("role", "content")


def is_mistral_common(tokenizer: PreTrainedTokenizerBase) -> bool:
    return type(tokenizer).__name__ == "MistralCommonBackend"


class MistralCommonRenderer(JinjaRenderer):
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        Renderer.__init__(self, tokenizer)
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        self.template, self.template_vars = None, {}
        self.end_of_turn_ids = frozenset({tokenizer.eos_token_id})
        # the backend's own instance checks the last message for serving; this one, from the same file, does not
        self.encoder = MistralTokenizer.from_file(
            str(tokenizer._tokenizer_path), mode=ValidationMode.agnostic
        )

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        return self.decode(self.render_ids(messages))

    def render_ids(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[int]:
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        from pydantic import ValidationError

        request = [{key: m[key] for key in KEPT_KEYS if key in m} for m in messages]
        try:
            return list(self.encoder.encode_chat_completion(ChatCompletionRequest(messages=request)).tokens)
        except (MistralCommonException, ValidationError) as exc:
            raise RendererError(f"mistral-common cannot encode this chat: {exc}") from None

    def generation_suffix(self, messages: Sequence[Message], role: str = "assistant") -> list[int]:
        self._check_assistant(role)
        return []  # `[/INST]` closes the user's turn: nothing opens the assistant's

    def _content_span(
        self, messages: Sequence[Message], index: int, ids: list[int]
    ) -> tuple[int, int] | None:
        if messages[index]["role"] == "system":
            return None
        return super()._content_span(messages, index, ids)
