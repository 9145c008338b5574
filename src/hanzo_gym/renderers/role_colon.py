"""`role_colon`: plain `User: …` / `Assistant: …` text for base models, which know no chat format.

    User: What is 2+2?⏎⏎Assistant: 4⏎⏎User:

A message is the header `Role:` and the output ` {content}⏎⏎`. Generation stops at the string `⏎⏎User:`, so
a trained assistant message is followed by `User:` (its stop overlap): the model learns to end its turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from hanzo_gym.renderers.base import (
    Message,
    ParseTermination,
    RenderedMessage,
    Renderer,
    RendererError,
    text_content,
    thinking_content,
)

STOP = "\n\nUser:"


class RoleColonRenderer(Renderer):
    has_extension_property = True

    @property
    def bos_tokens(self) -> list[int]:
        bos = self.tokenizer.bos_token_id
        return [bos] if bos is not None else []

    def render_message(self, index: int, messages: Sequence[Message]) -> RenderedMessage:
        message = messages[index]
        if thinking_content(message) is not None or message.get("tool_calls"):
            raise RendererError(f"role_colon renders text only; message {index} has reasoning or tool calls")
        stop_overlap = self.encode(STOP.removeprefix("\n\n")) if message["role"] == "assistant" else []
        return RenderedMessage(
            header=self.encode(f"{message['role'].capitalize()}:"),
            content=self.encode(f" {text_content(message)}\n\n"),
            stop_overlap=stop_overlap,
        )

    def generation_suffix(self, messages: Sequence[Message], role: str = "assistant") -> list[int]:
        return self.encode(f"{role.capitalize()}:")

    def get_stop_sequences(self) -> list[str]:
        return [STOP]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        tokens = list(tokens)
        eos = self.tokenizer.eos_token_id
        ends_with_eos = eos is not None and tokens[-1:] == [eos]
        if ends_with_eos:
            tokens = tokens[:-1]
        pieces = self.decode(tokens).split(STOP)
        if len(pieces) == 1:
            # A base model that stops by itself ends with EOS: a clean end; otherwise it was cut off.
            termination = ParseTermination.EOS if ends_with_eos else ParseTermination.MALFORMED
        elif len(pieces) == 2 and not ends_with_eos:
            termination = ParseTermination.STOP_SEQUENCE
        else:
            termination = ParseTermination.MALFORMED
        content = pieces[0].removeprefix(" ").removesuffix("\n\n")
        return {"role": "assistant", "content": content}, termination
