"""DeepSeek-V3.1 chat format: `deepseekv3` (non-thinking, the Hugging Face template's default) and
`deepseekv3_thinking`.

    <｜begin▁of▁sentence｜>{system}<｜User｜>{question}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>

The thinking variant opens the produced turn with `<think>` instead of `</think>`. The module also holds the
message helpers the kimi and gpt_oss renderers share (they would sit well in base.py).
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
    RendererError,
    ToolSpec,
    split_at_stop_token,
    text_content,
    thinking_content,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
TOOLS_INSTRUCTIONS = (
    "\n\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}tool_call_name{TOOL_SEP}tool_call_arguments{TOOL_CALL_END}{TOOL_CALLS_END}"
    "\n\nWhere:\n- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces"
)


# -- helpers shared with the kimi and gpt_oss renderers ------------------------------------------------------


def reasoning_and_text(message: Message) -> tuple[str, str]:
    """(reasoning, visible text); several thinking parts join into one block, as these formats carry one
    reasoning block per message."""
    return thinking_content(message) or "", text_content(message)


def tool_calls_of(message: Message) -> list[tuple[str, str, str | None]]:
    """(name, arguments as JSON text, id) per tool call, OpenAI's `{"function": {...}}` or HF's flat
    `{name, arguments}`; arguments given as a dict are serialised as the HF templates' `tojson` does."""
    calls = []
    for index, call in enumerate(message.get("tool_calls") or []):
        function = (call.get("function") or call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not function.get("name"):
            raise RendererError(
                f'tool call {index} needs {{"function": {{"name": ..., "arguments": ...}}}}; got {call!r}'
            )
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append((function["name"], arguments, call.get("id")))
    return calls


def think_parts(text: str) -> list[dict[str, str]]:
    """`<think>…</think>` blocks as thinking parts and the text around them as text parts; empty blocks and
    empty text vanish. An unclosed `<think>` (a truncated response) makes the rest of the text thinking."""
    parts: list[dict[str, str]] = []
    position = 0
    while position < len(text):
        start = text.find(THINK_OPEN, position)
        if start < 0:
            parts.append({"type": "text", "text": text[position:]})
            break
        if start > position:
            parts.append({"type": "text", "text": text[position:start]})
        end = text.find(THINK_CLOSE, start)
        thinking_end = len(text) if end < 0 else end
        thinking = text[start + len(THINK_OPEN) : thinking_end]
        if thinking:
            parts.append({"type": "thinking", "thinking": thinking})
        position = len(text) if end < 0 else end + len(THINK_CLOSE)
    return parts


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id:
        call["id"] = call_id
    return call


def checked_tool_call(
    name: str, arguments: str, raw_text: str, call_id: str | None = None
) -> tuple[dict[str, Any] | None, dict[str, str] | None]:
    """(tool call, None) when `arguments` is JSON, else (None, unparsed tool call with the error)."""
    arguments = arguments.strip()
    try:
        json.loads(arguments)
    except json.JSONDecodeError as error:
        return None, {"raw_text": raw_text, "error": f"invalid JSON arguments for {name}: {error}"}
    return tool_call(name, arguments, call_id), None


def assistant_message(
    parts: list[dict[str, str]],
    tool_calls: Sequence[dict[str, Any]] = (),
    unparsed_tool_calls: Sequence[dict[str, str]] = (),
) -> Message:
    """A parsed assistant message: content is a part list when thinking or tool calls are present (so that
    nothing about the structure is lost), else a string."""
    structured = bool(tool_calls or unparsed_tool_calls) or any(p["type"] == "thinking" for p in parts)
    message: Message = {
        "role": "assistant",
        "content": parts if structured else "".join(p["text"] for p in parts),
    }
    if tool_calls:
        message["tool_calls"] = list(tool_calls)
    if unparsed_tool_calls:
        message["unparsed_tool_calls"] = list(unparsed_tool_calls)
    return message


# -- DeepSeek-V3.1 -------------------------------------------------------------------------------------------


class DeepSeekV3Renderer(Renderer):
    """Non-thinking mode: `</think>` right after `<｜Assistant｜>` (in the header, so never trained) tells the
    model to answer directly; reasoning in any assistant message is dropped.

    A system message is only allowed first (rendered raw after BOS, as the template does); later ones are
    rendered as user messages when `system_role_as_user=True`."""

    has_extension_property = True
    thinking = False

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_role_as_user: bool = False):
        super().__init__(tokenizer)
        self.system_role_as_user = system_role_as_user
        # Look the always-used tokens up now so that a wrong tokenizer fails at construction.
        self.bos_id, self.eos_id = self.special_token(BOS), self.special_token(EOS)
        self.user_id, self.assistant_id = self.special_token(USER), self.special_token(ASSISTANT)
        self.think_open_id, self.think_close_id = (
            self.special_token(THINK_OPEN),
            self.special_token(THINK_CLOSE),
        )

    @property
    def bos_tokens(self) -> list[int]:
        return [self.bos_id]

    def get_stop_sequences(self) -> list[int]:
        return [self.eos_id]

    def render_message(self, index: int, messages: Sequence[Message]) -> RenderedMessage:
        message = messages[index]
        role = message["role"]
        if role == "system" and index == 0:
            return RenderedMessage(header=[], content=self.encode(text_content(message)))
        if role == "user" or (role == "system" and self.system_role_as_user):
            return RenderedMessage(header=[self.user_id], content=self.encode(text_content(message)))
        if role == "system":
            raise RendererError(
                f"message {index}: DeepSeek V3 takes a system message only first; "
                "pass system_role_as_user=True to render later ones as user messages"
            )
        if role == "tool":
            return RenderedMessage(
                header=[self.special_token(TOOL_OUTPUT_BEGIN)],
                content=self.encode(text_content(message)),
                end=[self.special_token(TOOL_OUTPUT_END)],
            )
        if role == "assistant":
            return self._render_assistant(index, messages)
        raise RendererError(f"message {index}: DeepSeek V3 has no role {role!r}")

    def _render_assistant(self, index: int, messages: Sequence[Message]) -> RenderedMessage:
        message = messages[index]
        reasoning, text = reasoning_and_text(message)
        if isinstance(message.get("content"), str) and THINK_CLOSE in text:
            # Reasoning written inline; the template itself keeps only what follows `</think>`.
            inline_reasoning, text = text.split(THINK_CLOSE, 1)
            reasoning += inline_reasoning.removeprefix(THINK_OPEN)
        is_target = self.thinking and index == len(messages) - 1
        if _follows_tool(index, messages):
            # After tool output the template writes no role token: the answer continues the tool turn.
            header: list[int] = []
            content = self._think_block(reasoning) if is_target and reasoning else []
        elif is_target:
            # The prompt prefilled `<think>`; the model writes the reasoning and closes the block itself.
            header = [self.assistant_id, self.think_open_id]
            content = self.encode(reasoning) + [self.think_close_id]
        else:
            header = [self.assistant_id, self.think_close_id]
            content = []
        content += self.encode(text) + self._render_tool_calls(message)
        return RenderedMessage(header=header, content=content, end=[self.eos_id])

    def _think_block(self, reasoning: str) -> list[int]:
        return [self.think_open_id, *self.encode(reasoning), self.think_close_id]

    def _render_tool_calls(self, message: Message) -> list[int]:
        calls = tool_calls_of(message)
        if not calls:
            return []
        tokens = [self.special_token(TOOL_CALLS_BEGIN)]
        for name, arguments, _ in calls:
            tokens += [self.special_token(TOOL_CALL_BEGIN), *self.encode(name), self.special_token(TOOL_SEP)]
            tokens += [*self.encode(arguments), self.special_token(TOOL_CALL_END)]
        return tokens + [self.special_token(TOOL_CALLS_END)]

    def create_conversation_prefix_with_tools(
        self, tools: Sequence[ToolSpec], system_prompt: str = ""
    ) -> list[Message]:
        # DeepSeek-V3.1's model card: tools are described in the (first) system message.
        if not tools:
            return [{"role": "system", "content": system_prompt}]
        blocks = "\n".join(
            f"### {tool['name']}\nDescription: {tool.get('description', '')}\n\n"
            f"Parameters: {json.dumps(tool.get('parameters', {}))}"
            for tool in tools
        )
        tools_text = f"\n\n## Tools\nYou have access to the following tools:\n\n{blocks}{TOOLS_INSTRUCTIONS}"
        return [{"role": "system", "content": system_prompt + tools_text}]

    def generation_suffix(self, messages: Sequence[Message], role: str = "assistant") -> list[int]:
        if role == "user":
            return [self.user_id]
        if role != "assistant":
            raise RendererError(f"DeepSeek V3 cannot open a {role!r} message")
        if _follows_tool(len(messages), messages):
            return []
        return [self.assistant_id, self.think_open_id if self.thinking else self.think_close_id]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        body, termination = split_at_stop_token(tokens, {self.eos_id})
        text = self.decode(body)
        if self.thinking and not text.startswith(THINK_OPEN) and THINK_CLOSE in text:
            text = THINK_OPEN + text  # the prompt supplied the opening `<think>`
        text, tool_calls, unparsed = _split_tool_calls(text)
        return assistant_message(think_parts(text), tool_calls, unparsed), termination


class DeepSeekV3ThinkingRenderer(DeepSeekV3Renderer):
    """Thinking mode: the generation prompt ends `<｜Assistant｜><think>`, the final assistant message is
    trained as `{reasoning}</think>{answer}<｜end▁of▁sentence｜>` (an empty block when it has no reasoning),
    and earlier assistant messages lose their reasoning and get `</think>` in the header, as the template
    renders history. Dropping past reasoning means no extension property."""

    has_extension_property = False
    thinking = True


def _follows_tool(index: int, messages: Sequence[Message]) -> bool:
    return index > 0 and messages[index - 1]["role"] == "tool"


_TOOL_CALL = re.compile(
    re.escape(TOOL_CALL_BEGIN) + r"(.*?)" + re.escape(TOOL_SEP) + r"(.*?)" + re.escape(TOOL_CALL_END),
    re.DOTALL,
)


def _split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]], list[dict[str, str]]]:
    """(text before the tool-call section, tool calls, unparsed tool calls)."""
    start = text.find(TOOL_CALLS_BEGIN)
    if start < 0:
        return text, [], []
    section = text[start + len(TOOL_CALLS_BEGIN) :]
    end = section.find(TOOL_CALLS_END)
    if end >= 0:
        section = section[:end]
    tool_calls, unparsed = [], []
    position = 0
    for match in _TOOL_CALL.finditer(section):
        call, error = checked_tool_call(match[1].strip(), match[2], match[0])
        tool_calls += [call] if call else []
        unparsed += [error] if error else []
        position = match.end()
    leftover = section[position:].strip()
    if leftover:  # a call cut off before `<｜tool▁call▁end｜>`
        unparsed.append({"raw_text": leftover, "error": "tool call is not closed"})
    return text[:start], tool_calls, unparsed
