"""gpt-oss chat format (OpenAI Harmony), `gpt_oss_*`: no BOS and no separators,

    <|start|>user<|message|>{question}<|end|>
    <|start|>assistant<|channel|>analysis<|message|>{reasoning}<|end|>
    <|start|>assistant<|channel|>final<|message|>{answer}<|return|>

Reasoning goes to the `analysis` channel, answers to `final`, tool calls to `commentary` addressed
`to=functions.{name}`. A finished answer ends `<|return|>`, the same answer in history `<|end|>`.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hanzo_gym.renderers.base import (
    Message,
    ParseTermination,
    RenderedMessage,
    Renderer,
    RendererError,
    split_at_stop_token,
    text_content,
)
from hanzo_gym.renderers.deepseek import (
    assistant_message,
    checked_tool_call,
    reasoning_and_text,
    tool_calls_of,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


START = "<|start|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"

REASONING_EFFORTS = ("low", "medium", "high")
SYSTEM_PROMPT = (
    "You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n"
    "Current date: {current_date}\n\n"
    "Reasoning: {reasoning_effort}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
)


class GptOssRenderer(Renderer):
    """`reasoning_effort=None` is `gpt_oss_no_sysprompt`; "low"/"medium"/"high" open every conversation with
    OpenAI's system message carrying that effort and `current_date` (today unless given, for reproducible
    tests). That system message is a fixed preamble like a BOS token, so it is never trained.

    A caller's `system` message becomes the `developer` message under `# Instructions`. Tool results are
    `tool` messages whose `name` is the function called. Every assistant message keeps its reasoning."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        reasoning_effort: str | None = None,
        current_date: str | datetime.date | None = None,
    ):
        super().__init__(tokenizer)
        if reasoning_effort not in (None, *REASONING_EFFORTS):
            raise RendererError(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)} or None; got {reasoning_effort!r}"
            )
        self.reasoning_effort = reasoning_effort
        self.current_date = current_date
        self.start_id, self.message_id = self.special_token(START), self.special_token(MESSAGE)
        self.channel_id, self.constrain_id = self.special_token(CHANNEL), self.special_token(CONSTRAIN)
        self.end_id, self.return_id, self.call_id = (self.special_token(t) for t in (END, RETURN, CALL))

    @property
    def bos_tokens(self) -> list[int]:
        if self.reasoning_effort is None:
            return []
        date = self.current_date or datetime.date.today()
        text = SYSTEM_PROMPT.format(current_date=str(date), reasoning_effort=self.reasoning_effort)
        return [*self._start("system"), self.message_id, *self.encode(text), self.end_id]

    def get_stop_sequences(self) -> list[int]:
        return [self.return_id, self.call_id]

    def _start(self, role: str) -> list[int]:
        return [self.start_id, *self.encode(role)]

    def _channel(self, channel: str, text: str) -> list[int]:
        return [self.channel_id, *self.encode(channel), self.message_id, *self.encode(text)]

    def render_message(self, index: int, messages: Sequence[Message]) -> RenderedMessage:
        message = messages[index]
        role = message["role"]
        text = text_content(message)
        if role == "assistant":
            return self._render_assistant(message, is_last=index == len(messages) - 1)
        if role == "tool":
            name = message.get("name")
            if not name:
                raise RendererError(
                    f"message {index}: gpt-oss addresses a tool result from its function, so the tool "
                    "message needs `name` (the function called)"
                )
            header = self._start(f"functions.{name.removeprefix('functions.')} to=assistant")
            return RenderedMessage(
                header=header, content=self._channel("commentary", text), end=[self.end_id]
            )
        if role == "system":
            # A caller's system prompt is what Harmony calls developer instructions.
            role, text = "developer", f"# Instructions\n\n{text}\n\n"
        elif role not in ("user", "developer"):
            raise RendererError(f"message {index}: gpt-oss has no role {role!r}")
        return RenderedMessage(
            header=self._start(role), content=[self.message_id, *self.encode(text)], end=[self.end_id]
        )

    def _render_assistant(self, message: Message, is_last: bool) -> RenderedMessage:
        reasoning, text = reasoning_and_text(message)
        calls = tool_calls_of(message)
        next_message = [self.end_id, *self._start("assistant")]
        content = self._channel("analysis", reasoning) + next_message if reasoning else []
        if not calls:
            content += self._channel("final", text)
            return RenderedMessage(
                header=self._start("assistant"),
                content=content,
                end=[self.return_id if is_last else self.end_id],
            )
        if text:  # text next to tool calls is a preamble the user sees
            content += self._channel("commentary", text) + next_message
        for position, (name, arguments, _) in enumerate(calls):
            if position:
                content += [self.call_id, *self._start("assistant")]
            content += [*self.encode(f" to=functions.{name}"), self.channel_id, *self.encode("commentary ")]
            content += [self.constrain_id, *self.encode("json"), self.message_id, *self.encode(arguments)]
        return RenderedMessage(header=self._start("assistant"), content=content, end=[self.call_id])

    def generation_suffix(self, messages: Sequence[Message], role: str = "assistant") -> list[int]:
        return self._start(role)

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        body, termination = split_at_stop_token(tokens, {self.return_id, self.call_id})
        text = self.decode(body)
        parts: list[dict[str, str]] = []
        tool_calls: list[dict[str, Any]] = []
        unparsed: list[dict[str, str]] = []
        found_message = False
        # The prompt ended `<|start|>assistant`, so the first segment has no role; later ones start with it.
        for segment in text.split(START):
            header, separator, content = segment.partition(MESSAGE)
            if not separator:
                continue
            found_message = True
            content = content.split(END, 1)[0]
            recipient, channel = (
                re.search(r"to=([^\s<]+)", header),
                re.search(r"<\|channel\|>([^\s<]+)", header),
            )
            if recipient and recipient[1].startswith("functions."):
                call, error = checked_tool_call(recipient[1].removeprefix("functions."), content, segment)
                tool_calls += [call] if call else []
                unparsed += [error] if error else []
            elif content and channel and channel[1] == "analysis":
                parts.append({"type": "thinking", "thinking": content})
            elif content:  # final, or a commentary preamble
                parts.append({"type": "text", "text": content})
        if not found_message:  # not Harmony at all (or cut off inside the first header): keep the raw text
            return {"role": "assistant", "content": text}, termination
        return assistant_message(parts, tool_calls, unparsed), termination
