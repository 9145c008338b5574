"""Qwen3's ChatML, token-identical to the Qwen3 tokenizer's own chat template.

    <|im_start|>user⏎Hi<|im_end|>⏎<|im_start|>assistant⏎<think>⏎…⏎</think>⏎⏎Hello<|im_end|>⏎

Spans: a header is `⏎` (the newline after the previous `<|im_end|>`) + `<|im_start|>{role}⏎`; the content
follows; the end is `<|im_end|>`; the final `⏎` is the conversation's trailer. Tool results render as user
turns wrapped in `<tool_response>`, consecutive ones sharing one turn; tool calls are `<tool_call>` JSON.

- `qwen3` (HF `enable_thinking=True`): assistant turns after the last user query are framed in a `<think>`
  block (the final one always, an empty block when it has no reasoning); earlier turns lose their reasoning.
- `qwen3_disable_thinking` (HF `enable_thinking=False`): the generation prompt ends with an empty think block;
  the final turn's empty block is therefore its header (not trained), and reasoning there is an error.
- `qwen3_instruct` (2507 Instruct models; also `chat_template: chatml`): no thinking at all.

Reasoning comes as `reasoning_content`, thinking content parts, or inline `<think>…</think>` in the content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hanzo_gym.renderers.base import (
    Message,
    ParseTermination,
    RenderedConversation,
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


EMPTY_THINK = "<think>\n\n</think>\n\n"
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class Qwen3InstructRenderer(Renderer):
    """ChatML with Qwen's tool conventions and no reasoning (the Qwen3 2507 Instruct models)."""

    frames_thinking = False  # whether assistant turns after the last query get `<think>` blocks
    disables_thinking = False  # whether the generation prompt pre-fills an empty think block
    has_extension_property = True

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        super().__init__(tokenizer)
        self.im_start = self.special_token("<|im_start|>")
        self.im_end = self.special_token("<|im_end|>")

    def render(self, messages: Sequence[Message]) -> RenderedConversation:
        conversation = super().render(messages)
        if messages:  # the template ends every turn with `<|im_end|>⏎`
            conversation.trailer = self.encode("\n")
        return conversation

    def render_message(self, index: int, messages: Sequence[Message]) -> RenderedMessage:
        message = messages[index]
        role = message["role"]
        newline = "\n" if index > 0 else ""
        if role == "tool":
            continues_group = index > 0 and messages[index - 1]["role"] == "tool"
            closes_group = index == len(messages) - 1 or messages[index + 1]["role"] != "tool"
            return RenderedMessage(
                header=self.encode(newline if continues_group else f"{newline}<|im_start|>user\n"),
                content=self.encode(f"<tool_response>\n{text_content(message)}\n</tool_response>"),
                end=[self.im_end] if closes_group else [],
            )
        if role in ("system", "user"):
            header, content = self.encode_joined(f"{newline}<|im_start|>{role}\n", text_content(message))
            return RenderedMessage(header=header, content=content, end=[self.im_end])
        if role == "assistant":
            return self._render_assistant(index, messages)
        raise RendererError(
            f"{type(self).__name__} has no role `{role}` (message {index}): system, user, assistant or tool"
        )

    def generation_suffix(self, messages: Sequence[Message], role: str = "assistant") -> list[int]:
        text = ("\n" if messages else "") + f"<|im_start|>{role}\n"
        if self.disables_thinking and role == "assistant":
            text += EMPTY_THINK
        return self.encode(text)

    def get_stop_sequences(self) -> list[int]:
        return [self.im_end]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        before_stop, termination = split_at_stop_token(tokens, {self.im_end})
        text = self.decode(before_stop)
        reasoning = ""
        if self.frames_thinking:
            reasoning, text = _split_think_block(text)
        message: Message = {"role": "assistant"}
        start = text.find("<tool_call>")
        if start >= 0:
            # Rendered as `content` + (`⏎` if content) + the calls joined by `⏎`.
            text, calls_text = text[:start].removesuffix("\n"), text[start:]
            message.update(_parse_tool_calls(calls_text))
        message["content"] = (
            [{"type": "thinking", "thinking": reasoning}, {"type": "text", "text": text}]
            if reasoning
            else text
        )
        return message, termination

    def create_conversation_prefix_with_tools(
        self, tools: Sequence[ToolSpec], system_prompt: str = ""
    ) -> list[Message]:
        # What the HF template writes for `tools=[{"type": "function", "function": tool}, ...]`.
        lines = "".join(
            "\n" + json.dumps({"type": "function", "function": tool}, ensure_ascii=False) for tool in tools
        )
        prefix = f"{system_prompt}\n\n" if system_prompt else ""
        return [{"role": "system", "content": prefix + TOOLS_PREAMBLE + lines + TOOLS_INSTRUCTIONS}]

    # -- assistant turns -------------------------------------------------------------------------
    def _render_assistant(self, index: int, messages: Sequence[Message]) -> RenderedMessage:
        message = messages[index]
        reasoning, text = self._reasoning_and_text(message, index)
        header = ("\n" if index > 0 else "") + "<|im_start|>assistant\n"
        body = text
        last_query = _last_query_index(messages)
        after_query = index > (len(messages) - 1 if last_query is None else last_query)
        if self.frames_thinking and after_query and (index == len(messages) - 1 or reasoning):
            think = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
            if self.disables_thinking and think == EMPTY_THINK:  # the generation prompt supplies it
                header, think = header + think, ""
            body = think + text.lstrip("\n")
        body += _tool_calls_text(message.get("tool_calls") or [], text)
        header_tokens, content = self.encode_joined(header, body)
        return RenderedMessage(header=header_tokens, content=content, end=[self.im_end])

    def _reasoning_and_text(self, message: Message, index: int) -> tuple[str, str]:
        """The assistant message's reasoning and its text, by the HF template's rules: `reasoning_content`
        (or thinking parts) first, else a `<think>…</think>` prefix of the content."""
        reasoning, text = thinking_content(message), text_content(message)
        if not self.frames_thinking:
            if reasoning is not None:
                raise RendererError(f"{type(self).__name__} renders no reasoning; message {index} has some")
            return "", text
        if reasoning is not None:
            return reasoning, text
        if "</think>" in text:
            thought, answer = text.split("</think>")[0], text.split("</think>")[-1]
            return thought.rstrip("\n").split("<think>")[-1].lstrip("\n"), answer.lstrip("\n")
        return "", text


class Qwen3Renderer(Qwen3InstructRenderer):
    frames_thinking = True
    has_extension_property = False  # past turns lose their reasoning, so a turn is no prefix of the next


class Qwen3DisableThinkingRenderer(Qwen3Renderer):
    disables_thinking = True

    def check_targets(self, messages: Sequence[Message], trained: Sequence[bool]) -> None:
        last_query = _last_query_index(messages)
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or not trained[index]:
                continue
            if last_query is None:
                # Without a user query the template frames no turn: the prompt's empty block would be missing.
                raise RendererError(
                    "qwen3_disable_thinking needs a user message before a trained assistant turn"
                )
            if index > last_query and self._reasoning_and_text(message, index)[0].strip("\n"):
                raise RendererError(
                    f"message {index} has reasoning, which qwen3_disable_thinking cannot train on "
                    "(its prompt closes the think block); use the qwen3 renderer"
                )


def _last_query_index(messages: Sequence[Message]) -> int | None:
    """The last user message that is a real query, not a `<tool_response>` wrapped as a user turn."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index]["role"] == "user":
            text = text_content(messages[index])
            if not (text.startswith("<tool_response>") and text.endswith("</tool_response>")):
                return index
    return None


def _tool_calls_text(tool_calls: Sequence[dict[str, Any]], content: str) -> str:
    pieces = []
    for number, call in enumerate(tool_calls):
        function = call.get("function") or call  # OpenAI's {"function": {...}} or HF's flat {name, arguments}
        arguments = function.get("arguments")
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        separator = "\n" if number > 0 or content else ""
        pieces.append(
            f'{separator}<tool_call>\n{{"name": "{function["name"]}", "arguments": {arguments}}}\n</tool_call>'
        )
    return "".join(pieces)


def _split_think_block(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a sampled turn that opens with `<think>⏎…⏎</think>⏎⏎`."""
    if "</think>" in text:
        thought, _, answer = text.partition("</think>")
        return thought.split("<think>")[-1].strip("\n"), answer.lstrip("\n")
    if "<think>" in text:  # cut off while thinking
        return text.split("<think>", 1)[1].strip("\n"), ""
    return "", text


def _parse_tool_calls(text: str) -> dict[str, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    unparsed: list[dict[str, str]] = []
    for match in TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError as exc:
            unparsed.append({"raw_text": match.group(0), "error": f"bad tool call JSON: {exc}"})
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            unparsed.append({"raw_text": match.group(0), "error": "a tool call needs a `name` string"})
            continue
        arguments_json = json.dumps(body.get("arguments", {}), ensure_ascii=False)
        calls.append({"type": "function", "function": {"name": body["name"], "arguments": arguments_json}})
    rest = TOOL_CALL.sub("", text)
    if "<tool_call>" in rest:
        unparsed.append({"raw_text": rest[rest.index("<tool_call>") :], "error": "unclosed <tool_call>"})
    found: dict[str, list[dict[str, Any]]] = {}
    if calls:
        found["tool_calls"] = calls
    if unparsed:
        found["unparsed_tool_calls"] = unparsed
    return found
