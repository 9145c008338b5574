"""The renderer interface: messages ↔ tokens for one chat format, with Tinker's names and semantics.

A renderer turns a conversation into a `RenderedConversation`: optional BOS tokens, then per message a header
(role markers), its content and its end-of-turn marker, then trailing tokens. Everything that trains on chat data
is a weighting of those parts: Tinker's `TrainOnWhat` modes (`build_supervised_example`) and Axolotl's
`roles_to_train` / `train_on_eos` / `train_on_inputs` (`axolotl_labels`) are two views of the same spans.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from hanzo_gym.errors import GymError
from hanzo_gym.model_input import EncodedTextChunk, ModelInput

Message = dict[
    str, Any
]  # role, content (str or list of parts), optional tool_calls, trainable, name, tool_call_id


class RendererError(GymError):
    """A conversation the renderer cannot express (e.g. reasoning given to a thinking-disabled renderer)."""


class TrainOnWhat(StrEnum):
    LAST_ASSISTANT_MESSAGE = "last_assistant_message"
    LAST_ASSISTANT_TURN = "last_assistant_turn"
    ALL_ASSISTANT_MESSAGES = "all_assistant_messages"
    ALL_MESSAGES = "all_messages"
    ALL_TOKENS = "all_tokens"
    ALL_USER_AND_SYSTEM_MESSAGES = "all_user_and_system_messages"
    CUSTOMIZED = "customized"


class ParseTermination(StrEnum):
    STOP_SEQUENCE = "stop_sequence"  # ended with the renderer's stop token / string
    EOS = "eos"  # ended with the tokenizer's EOS: a clean end for base models
    MALFORMED = "malformed"  # no stop (truncated) or more than one

    @property
    def is_clean(self) -> bool:
        return self is not ParseTermination.MALFORMED

    @property
    def is_stop_sequence(self) -> bool:
        return self is ParseTermination.STOP_SEQUENCE


@dataclass
class RenderedMessage:
    header: list[int]  # role markers: trained only under ALL_TOKENS
    content: list[int]  # what the message says (reasoning and tool calls included as rendered)
    end: list[int] = field(default_factory=list)  # end-of-turn marker, trained with the content
    stop_overlap: list[int] = field(
        default_factory=list
    )  # only after the final message (role_colon's "User:")

    @property
    def output(self) -> list[int]:
        return self.content + self.end


@dataclass
class RenderedConversation:
    bos: list[int]
    messages: list[RenderedMessage]
    trailer: list[int] = field(default_factory=list)  # tokens a template emits after the last message

    def tokens(self) -> list[int]:
        out = list(self.bos)
        for index, message in enumerate(self.messages):
            out += message.header + message.output
            if index == len(self.messages) - 1:
                out += message.stop_overlap
        return out + self.trailer


class Renderer(ABC):
    """Subclasses implement `render_message`, `generation_suffix`, `get_stop_sequences` and `parse_response`;
    a renderer that needs the whole conversation at once (the Jinja one) overrides `render` instead."""

    has_extension_property = False

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer

    # -- helpers for subclasses ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def special_token(self, text: str) -> int:
        token_id = self.tokenizer.convert_tokens_to_ids(text)
        if (
            token_id is None
            or token_id == self.tokenizer.unk_token_id
            or self.tokenizer.decode([token_id]) != text
        ):
            raise RendererError(
                f"{type(self).__name__} needs the special token {text!r}; this tokenizer lacks it"
            )
        return token_id

    @property
    def bos_tokens(self) -> list[int]:
        return []

    # -- what each format defines ----------------------------------------------------------------
    def render_message(self, index: int, messages: Sequence[Message]) -> RenderedMessage:
        raise NotImplementedError

    @abstractmethod
    def generation_suffix(self, messages: Sequence[Message], role: str = "assistant") -> list[int]:
        """Tokens that open a new message of `role` after `messages` (the header of an empty message)."""

    @abstractmethod
    def get_stop_sequences(self) -> list[int] | list[str]: ...

    @abstractmethod
    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]: ...

    # -- shared operations -----------------------------------------------------------------------
    def render(self, messages: Sequence[Message]) -> RenderedConversation:
        check_text_only(messages)
        return RenderedConversation(
            bos=self.bos_tokens, messages=[self.render_message(i, messages) for i in range(len(messages))]
        )

    def build_generation_prompt(
        self, messages: Sequence[Message], role: str = "assistant", prefill: str | None = None
    ) -> ModelInput:
        conversation = self.render(messages)
        # A prompt is every message's header and output; stop_overlap and trailer belong to training targets.
        tokens = list(conversation.bos)
        for rendered in conversation.messages:
            tokens += rendered.header + rendered.output
        tokens += self.generation_suffix(messages, role)
        if prefill:
            tokens += self.encode(prefill)
        return ModelInput([EncodedTextChunk(tokens)])

    def build_supervised_example(
        self,
        messages: Sequence[Message],
        train_on_what: TrainOnWhat | str = TrainOnWhat.LAST_ASSISTANT_MESSAGE,
    ) -> tuple[ModelInput, torch.Tensor]:
        """The conversation's tokens and a 0/1 weight per token (unshifted: weights[i] is for token i)."""
        mode = TrainOnWhat(train_on_what)
        conversation = self.render(messages)
        trained = messages_trained(messages, mode)
        tokens = list(conversation.bos)
        weights = [0.0] * len(tokens)
        for index, (message, rendered) in enumerate(zip(messages, conversation.messages)):
            output_weight = 1.0 if trained[index] else 0.0
            tokens += rendered.header
            weights += [1.0 if mode is TrainOnWhat.ALL_TOKENS else 0.0] * len(rendered.header)
            tokens += rendered.output
            weights += [output_weight] * len(rendered.output)
            if index == len(messages) - 1:
                tokens += rendered.stop_overlap
                weights += [output_weight] * len(rendered.stop_overlap)
        tokens += conversation.trailer
        weights += [1.0 if mode is TrainOnWhat.ALL_TOKENS else 0.0] * len(conversation.trailer)
        return ModelInput([EncodedTextChunk(tokens)]), torch.tensor(weights, dtype=torch.float32)


def messages_trained(messages: Sequence[Message], mode: TrainOnWhat) -> list[bool]:
    """Which messages' outputs carry weight 1 under `mode` (headers are handled by the caller)."""
    roles = [m["role"] for m in messages]
    if mode is TrainOnWhat.CUSTOMIZED:
        missing = [i for i, m in enumerate(messages) if "trainable" not in m]
        if missing:
            raise RendererError(
                f"train_on_what=customized needs `trainable` on every message; message {missing[0]}"
            )
        return [bool(m["trainable"]) for m in messages]
    with_flag = [i for i, m in enumerate(messages) if "trainable" in m]
    if with_flag:
        raise RendererError(
            f"message {with_flag[0]} sets `trainable`, which only train_on_what=customized reads"
        )
    if mode in (TrainOnWhat.ALL_MESSAGES, TrainOnWhat.ALL_TOKENS):
        return [True] * len(messages)
    if mode is TrainOnWhat.ALL_ASSISTANT_MESSAGES:
        return [role == "assistant" for role in roles]
    if mode is TrainOnWhat.ALL_USER_AND_SYSTEM_MESSAGES:
        return [role in ("user", "system") for role in roles]
    if mode is TrainOnWhat.LAST_ASSISTANT_MESSAGE:
        return [i == len(roles) - 1 and role == "assistant" for i, role in enumerate(roles)]
    # LAST_ASSISTANT_TURN: assistant messages after the last user message
    last_user = max((i for i, role in enumerate(roles) if role == "user"), default=-1)
    return [i > last_user and role == "assistant" for i, role in enumerate(roles)]


def check_text_only(messages: Sequence[Message]) -> None:
    for index, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("text", "thinking"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise RendererError(
                        f"message {index} has a `{kind}` content part: renderers are text-only for now "
                        "(text and thinking parts)"
                    )
