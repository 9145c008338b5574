"""`llama3`: the Llama 3 instruct format, without the "Cutting Knowledge Date" preamble of the 3.1+ templates.

    <|begin_of_text|><|start_header_id|>user<|end_header_id|>⏎⏎Hi<|eot_id|><|start_header_id|>assistant…

Content is trimmed as Meta's template does (`message['content'] | trim`). No tool calls (the format's
`ipython` tool protocol is deliberately unsupported) and no reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hanzo_gym.renderers.base import (
    Message,
    ParseTermination,
    RenderedMessage,
    Renderer,
    RendererError,
    split_at_stop_token,
    text_content,
    thinking_content,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Llama3Renderer(Renderer):
    has_extension_property = True

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        super().__init__(tokenizer)
        self.begin_of_text = self.special_token("<|begin_of_text|>")
        self.eot = self.special_token("<|eot_id|>")
        self.special_token("<|start_header_id|>")

    @property
    def bos_tokens(self) -> list[int]:
        return [self.begin_of_text]

    def render_message(self, index: int, messages: Sequence[Message]) -> RenderedMessage:
        message = messages[index]
        if message.get("tool_calls"):
            raise RendererError(f"llama3 has no tool-calling format; message {index} has tool calls")
        if thinking_content(message) is not None:
            raise RendererError(f"llama3 has no reasoning format; message {index} carries reasoning")
        return RenderedMessage(
            header=self._header(message["role"]),
            content=self.encode(text_content(message).strip()),
            end=[self.eot],
        )

    def generation_suffix(self, messages: Sequence[Message], role: str = "assistant") -> list[int]:
        return self._header(role)

    def get_stop_sequences(self) -> list[int]:
        return [self.eot]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        content, termination = split_at_stop_token(tokens, {self.eot})
        return {"role": "assistant", "content": self.decode(content)}, termination

    def _header(self, role: str) -> list[int]:
        return self.encode(f"<|start_header_id|>{role}<|end_header_id|>\n\n")
