"""Kimi K2 (Kimi-K2-Thinking) chat format, `kimi_k2`: messages concatenated with no separators,

    <|im_system|>system<|im_middle|>{system}<|im_end|><|im_user|>user<|im_middle|>{question}<|im_end|>
    <|im_assistant|>assistant<|im_middle|><think>{reasoning}</think>{answer}<|im_end|>

with the default system message Moonshot's template inserts when a conversation has none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hanzo_gym.renderers.base import (
    Message,
    ParseTermination,
    RenderedMessage,
    Renderer,
    ToolSpec,
    split_at_stop_token,
    text_content,
)
from hanzo_gym.renderers.deepseek import (
    assistant_message,
    checked_tool_call,
    reasoning_and_text,
    think_parts,
    tool_calls_of,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_MIDDLE = "<|im_middle|>"
IM_END = "<|im_end|>"
TOOL_CALLS_SECTION_BEGIN = "<|tool_calls_section_begin|>"
TOOL_CALLS_SECTION_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"


class KimiK2Renderer(Renderer):
    """Assistant messages of the current turn (those after the last earlier assistant message without tool
    calls) keep their reasoning; older ones get an empty `<think></think>`, as the template renders history.
    `strip_thinking_from_history=False` keeps every message's reasoning, which gives the extension property.

    Tool declarations are a `tool_declare` message (before the system message); tool results are `tool`
    messages with `name` and `tool_call_id`, rendered under `## Return of {tool_call_id}`."""

    DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

    def __init__(self, tokenizer: PreTrainedTokenizerBase, strip_thinking_from_history: bool = True):
        super().__init__(tokenizer)
        self.strip_thinking_from_history = strip_thinking_from_history
        # `<think>`/`</think>` are written as text, so they need not be single tokens in this tokenizer.
        self.role_ids = {
            "system": self.special_token(IM_SYSTEM),
            "user": self.special_token(IM_USER),
            "assistant": self.special_token(IM_ASSISTANT),
        }
        self.middle_id, self.end_id = self.special_token(IM_MIDDLE), self.special_token(IM_END)

    @property
    def has_extension_property(self) -> bool:  # type: ignore[override]
        return not self.strip_thinking_from_history

    def get_stop_sequences(self) -> list[int]:
        return [self.end_id]

    def _header(self, role: str, name: str) -> list[int]:
        # user and assistant have their own markers; every other role (system, tool, tool_declare) is a system one
        marker = self.role_ids.get(role, self.role_ids["system"])
        return [marker, *self.encode(name), self.middle_id]

    def _default_system_header(self, index: int, messages: Sequence[Message]) -> list[int]:
        """The template's default system message when the conversation has none, placed at the message it
        precedes. It is part of that message's header (trained only under ALL_TOKENS) rather than a message of
        its own so that the rendered messages stay one-to-one with the caller's."""
        if index != _default_system_position(messages):
            return []
        return [*self._header("system", "system"), *self.encode(self.DEFAULT_SYSTEM_PROMPT), self.end_id]

    def render_message(self, index: int, messages: Sequence[Message]) -> RenderedMessage:
        message = messages[index]
        role = message["role"]
        header = self._default_system_header(index, messages) + self._header(
            role, message.get("name") or role
        )
        if role == "assistant":
            content = self._render_assistant(message, keep_reasoning=self._keeps_reasoning(index, messages))
        elif role == "tool":
            # `\n` starts the content so that the result text is tokenised as it is in the whole template output
            header += self.encode(f"## Return of {message.get('tool_call_id', '')}")
            content = self.encode("\n" + text_content(message))
        else:
            content = self.encode(text_content(message))
        return RenderedMessage(header=header, content=content, end=[self.end_id])

    def _keeps_reasoning(self, index: int, messages: Sequence[Message]) -> bool:
        if not self.strip_thinking_from_history:
            return True
        # The final message is the one being produced or trained, so the search for the history boundary
        # leaves it out (the template, rendering a finished conversation, would count it as history).
        history_end = max(
            (i for i, m in enumerate(messages[:-1]) if m["role"] == "assistant" and not m.get("tool_calls")),
            default=-1,
        )
        return index > history_end

    def _render_assistant(self, message: Message, keep_reasoning: bool) -> list[int]:
        reasoning, text = reasoning_and_text(message)
        tokens = self.encode(f"<think>{reasoning if keep_reasoning else ''}</think>{text}")
        calls = tool_calls_of(message)
        if not calls:
            return tokens
        tokens.append(self.special_token(TOOL_CALLS_SECTION_BEGIN))
        for index, (name, arguments, call_id) in enumerate(calls):
            tokens += [
                self.special_token(TOOL_CALL_BEGIN),
                *self.encode(call_id or f"functions.{name}:{index}"),
            ]
            tokens += [self.special_token(TOOL_CALL_ARGUMENT_BEGIN), *self.encode(arguments)]
            tokens.append(self.special_token(TOOL_CALL_END))
        return tokens + [self.special_token(TOOL_CALLS_SECTION_END)]

    def create_conversation_prefix_with_tools(
        self, tools: Sequence[ToolSpec], system_prompt: str = ""
    ) -> list[Message]:
        # The template declares tools before the system message, keys sorted (Kimi's tokenizer sorts them
        # before templating), compact separators as its `tojson(separators=(',', ':'))`.
        prefix: list[Message] = []
        if tools:
            declared = [{"type": "function", "function": dict(tool)} for tool in tools]
            content = json.dumps(declared, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
            prefix.append({"role": "tool_declare", "content": content})
        return [*prefix, {"role": "system", "content": system_prompt or self.DEFAULT_SYSTEM_PROMPT}]

    def generation_suffix(self, messages: Sequence[Message], role: str = "assistant") -> list[int]:
        return self._default_system_header(len(messages), messages) + self._header(role, role)

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        body, termination = split_at_stop_token(tokens, {self.end_id})
        text, tool_calls, unparsed = _split_tool_calls(self.decode(body))
        return assistant_message(think_parts(text), tool_calls, unparsed), termination


def _default_system_position(messages: Sequence[Message]) -> int | None:
    """Where the default system message goes: first, or after a leading `tool_declare` message; None when the
    conversation brings its own system message."""
    roles = [m["role"] for m in messages]
    position = 1 if roles[:1] == ["tool_declare"] else 0
    if position < len(roles) and roles[position] == "system":
        return None
    return position


_TOOL_CALL = re.compile(
    re.escape(TOOL_CALL_BEGIN)
    + r"(.*?)"
    + re.escape(TOOL_CALL_ARGUMENT_BEGIN)
    + r"(.*?)"
    + re.escape(TOOL_CALL_END),
    re.DOTALL,
)


def _tool_name(call_id: str) -> str:
    """`functions.get_weather:0` → `get_weather`: the id carries the function name."""
    return call_id.split(":", 1)[0].removeprefix("functions.")


def _split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]], list[dict[str, str]]]:
    """(text before the tool-call section, tool calls, unparsed tool calls)."""
    start = text.find(TOOL_CALLS_SECTION_BEGIN)
    if start < 0:
        return text, [], []
    section = text[start + len(TOOL_CALLS_SECTION_BEGIN) :]
    end = section.find(TOOL_CALLS_SECTION_END)
    if end >= 0:
        section = section[:end]
    tool_calls, unparsed = [], []
    position = 0
    for match in _TOOL_CALL.finditer(section):
        call_id = match[1].strip()
        call, error = checked_tool_call(_tool_name(call_id), match[2], match[0], call_id)
        tool_calls += [call] if call else []
        unparsed += [error] if error else []
        position = match.end()
    leftover = section[position:].strip()
    if leftover:  # a call cut off before `<|tool_call_end|>`
        unparsed.append({"raw_text": leftover, "error": "tool call is not closed"})
    return text[:start], tool_calls, unparsed
