"""A renderer over any Hugging Face chat template (`chat_template: tokenizer_default` and inline Jinja).

Tokens are exactly `tokenizer.apply_chat_template`'s. A template says nothing about which tokens belong to
which message, so the spans are measured: each message's content is where the full rendering changes when
only that message's content is swapped for a dummy; its end is the end-of-turn token right after; the header
is what lies between. (Rendering prefixes instead mislabels Qwen3, whose last assistant turn of a prefix gets
a `<think>` block that the same turn lacks in the full conversation.)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError, TemplateSyntaxError

from hanzo_gym.records import EncodedTextChunk, ModelInput
from hanzo_gym.renderers.base import (
    Message,
    ParseTermination,
    RenderedConversation,
    RenderedMessage,
    Renderer,
    RendererError,
    check_text_only,
    split_at_stop_token,
    text_content,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# Tokens that close a turn in common chat formats. The tokenizer's eos alone is not enough: Llama 3's eos is
# `<|end_of_text|>` but its turns end with `<|eot_id|>`.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
)
# How far after a turn's content its end-of-turn token may sit (e.g. Llama 3 trims trailing text before it).
END_TOKEN_WINDOW = 3
# How many tokens of template text may sit between the assistant header and the content (Qwen3's `<think>\n`
# is 2); bounds the search for the header so that it never reaches back into an earlier turn.
MAX_OPENER_TOKENS = 8
DUMMY_TEXT = "dummy_message"
# Message keys whose text the model generates as part of its turn: left out of the dummy turn so that what the
# template renders from them counts as the turn's content (and is trained).
GENERATED_KEYS = ("reasoning_content", "reasoning", "thinking", "tool_calls")
PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def tokenizer_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The tokenizer's own template; of several named ones, the one called `default`."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    return template or None


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    # Added (control) tokens only: Qwen's BPE also has `</s>` as ordinary text, which ends nothing.
    added = tokenizer.get_added_vocab()
    ids = {added[token] for token in END_OF_TURN_TOKENS if token in added}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class JinjaRenderer(Renderer):
    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str | None = None, **template_vars: Any):
        """`template` defaults to the tokenizer's own; `template_vars` reach the template (`enable_thinking`)."""
        super().__init__(tokenizer)
        template = template if template is not None else tokenizer_template(tokenizer)
        if not template:
            raise RendererError("the tokenizer has no chat template; give one")
        self.template = template
        self.template_vars = template_vars
        self.end_of_turn_ids = end_of_turn_ids(tokenizer)
        try:  # a syntax error should surface now, not on the first conversation
            self.render_text(PROBE)
        except RendererError as exc:
            if isinstance(exc.__cause__, TemplateSyntaxError):
                syntax = exc.__cause__
                raise RendererError(f"Jinja syntax error on line {syntax.lineno}: {syntax.message}") from None

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages),
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_vars,
            )
        except (TemplateError, TypeError) as exc:  # raise_exception, an undefined field, `+` on a non-string
            raise RendererError(f"chat template failed: {exc}") from exc

    def render_ids(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[int]:
        """The conversation's tokens: the template's text, tokenized."""
        return self.encode(self.render_text(messages, add_generation_prompt))

    def render(self, messages: Sequence[Message]) -> RenderedConversation:
        check_text_only(messages)
        ids = self.render_ids(messages)
        spans = [self._content_span(messages, index, ids) for index in range(len(messages))]
        bos = ids[:1] if self._emits_bos and ids[:1] == [self.tokenizer.bos_token_id] else []
        boundary = len(bos)
        rendered = []
        for index, span in enumerate(spans):
            if span is None:  # the template shows nothing of this message: its tokens fall to the next header
                rendered.append(RenderedMessage(header=[], content=[]))
                continue
            next_start = next((s[0] for s in spans[index + 1 :] if s is not None), len(ids))
            start = max(span[0], boundary)
            end = max(min(span[1], next_start), start)
            end_token = self._end_token_position(ids, end, next_start)
            stop = end if end_token is None else end_token + 1
            rendered.append(RenderedMessage(ids[boundary:start], ids[start:end], ids[end:stop]))
            boundary = stop
        return RenderedConversation(bos=bos, messages=rendered, trailer=ids[boundary:])

    def build_generation_prompt(
        self, messages: Sequence[Message], role: str = "assistant", prefill: str | None = None
    ) -> ModelInput:
        self._check_assistant(role)
        check_text_only(messages)
        tokens = self.render_ids(messages, add_generation_prompt=True)
        return ModelInput([EncodedTextChunk(tokens + self.encode(prefill or ""))])

    def generation_suffix(self, messages: Sequence[Message], role: str = "assistant") -> list[int]:
        self._check_assistant(role)
        with_prompt = self.render_text(messages, add_generation_prompt=True)
        without_prompt = self.render_text(messages)
        if not with_prompt.startswith(without_prompt):
            return []
        return self.encode(with_prompt[len(without_prompt) :])

    def get_stop_sequences(self) -> list[int]:
        return list(self._stop_tokens)

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        content, termination = split_at_stop_token(tokens, set(self._stop_tokens))
        return {"role": "assistant", "content": self.decode(content)}, termination

    # -- measuring spans -------------------------------------------------------------------------
    @cached_property
    def _emits_bos(self) -> bool:
        # A BOS occurs once, at the start; SmolLM2's bos `<|im_start|>` opens every message and is no BOS.
        bos = self.tokenizer.bos_token_id
        return bos is not None and self.render_ids(PROBE).count(bos) == 1

    @cached_property
    def _stop_tokens(self) -> list[int]:
        """The end-of-turn token of an assistant message, else the tokenizer's eos."""
        conversation = self.render(PROBE)
        end = conversation.messages[-1].end
        if end:
            return [end[-1]]
        if self.tokenizer.eos_token_id is None:
            raise RendererError("the chat template ends assistant turns with no token and there is no eos")
        return [self.tokenizer.eos_token_id]

    def _content_span(
        self, messages: Sequence[Message], index: int, ids: list[int]
    ) -> tuple[int, int] | None:
        """Token range [start, end) of message `index`'s content inside the full conversation's `ids`: where
        the rendering changes when only this message's content is swapped for a dummy."""
        message = messages[index]
        dummy = {key: value for key, value in message.items() if key not in GENERATED_KEYS}
        dummy["content"] = _dummy_for(text_content(message))
        other = self.render_ids([*messages[:index], dummy, *messages[index + 1 :]])
        prefix = _common_prefix(ids, other)
        if prefix == len(ids) == len(other):
            return None
        suffix = _common_prefix(ids[::-1], other[::-1], limit=min(len(ids), len(other)) - prefix)
        start, end = prefix, len(ids) - suffix
        if message["role"] == "assistant":
            start = self._after_assistant_header(messages, index, ids, start)
        return start, end

    def _after_assistant_header(
        self, messages: Sequence[Message], index: int, ids: list[int], start: int
    ) -> int:
        """Move `start` back over text the template puts between the assistant header and the content (Qwen3's
        `<think>` opener): the model generates it after the generation prompt, so it belongs to the turn."""
        if index == 0:
            return start
        try:
            header = self.generation_suffix(messages[:index])
        except RendererError:  # a template that cannot render this prefix: keep the content span
            return start
        if not header:
            return start
        position = start
        while position >= max(len(header), start - MAX_OPENER_TOKENS):
            if ids[position - len(header) : position] == header:
                return position
            if ids[position - 1] in self.end_of_turn_ids:  # reached the previous turn: no header for this one
                break
            position -= 1
        return start

    def _end_token_position(self, ids: list[int], end: int, limit: int) -> int | None:
        for position in range(end, min(end + END_TOKEN_WINDOW + 1, limit)):
            if ids[position] in self.end_of_turn_ids:
                return position
        return None

    @staticmethod
    def _check_assistant(role: str) -> None:
        if role != "assistant":
            raise RendererError(f"a Jinja chat template only opens assistant turns, not `{role}`")


def _dummy_for(content: str) -> str:
    # First and last characters unlike the content's (templates often strip it), so that no content token is
    # mistaken for template text shared by both renderings: content "[[x" and dummy "[[dummy" share "[[".
    text = content.strip()
    opener = "<" if text.startswith("[") else "["
    closer = ">" if text.endswith("]") else "]"
    return f"{opener}{opener}{DUMMY_TEXT}{closer}{closer}"


def _common_prefix(a: list[int], b: list[int], limit: int | None = None) -> int:
    limit = min(len(a), len(b)) if limit is None else limit
    for position in range(limit):
        if a[position] != b[position]:
            return position
    return limit
