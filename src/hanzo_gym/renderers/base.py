"""The renderer interface: messages ↔ tokens for one chat format, with Tinker's names and semantics.

A renderer turns a conversation into a `RenderedConversation`: optional BOS tokens, then per message a header
(role markers), its content and its end-of-turn marker, then trailing tokens. Everything that trains on chat data
is a weighting of those parts: Tinker's `TrainOnWhat` modes (`build_supervised_example`) and Axolotl's
`roles_to_train` / `train_on_eos` / `train_on_inputs` (`axolotl_labels`) are two views of the same spans.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from hanzo_gym.errors import GymError
from hanzo_gym.records import IGNORE_INDEX, EncodedTextChunk, ModelInput

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

# role, content (str or list of text/thinking parts), optional reasoning_content, tool_calls, trainable, name,
# tool_call_id
Message = dict[str, Any]
ToolSpec = dict[str, Any]  # name, description, parameters (a JSON schema)


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

    def encode_joined(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """The tokens of `first + second`, as one tokenization, split where `first` ends.

        Encoding the two apart differs from a chat template's single encoding when a token spans the boundary:
        a header ending in "\n" before content starting with "\n" is one "\n\n" token. That token goes with
        `first` (the header), so the joined tokens stay exactly what `apply_chat_template` gives."""
        alone = self.encode(first)
        joined = self.encode(first + second)
        if joined[: len(alone)] == alone:
            return alone, joined[len(alone) :]
        for count in range(1, len(joined) + 1):
            if len(self.decode(joined[:count])) >= len(first):
                return joined[:count], joined[count:]
        return joined, []

    def decode(self, tokens: Sequence[int]) -> str:
        # Exact text: no special tokens dropped, no "clean-up" of spaces before punctuation (Llama's default).
        return self.tokenizer.decode(
            list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

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

    def create_conversation_prefix_with_tools(
        self, tools: Sequence[ToolSpec], system_prompt: str = ""
    ) -> list[Message]:
        """The messages that declare `tools` (and `system_prompt`) in this format's own way."""
        raise RendererError(f"{type(self).__name__} has no tool-calling format")

    def check_targets(self, messages: Sequence[Message], trained: Sequence[bool]) -> None:
        """Raise RendererError if a message to be trained (`trained[i]`) is one this format cannot produce,
        e.g. reasoning under a renderer whose generation prompt closes the think block."""

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
        self.check_targets(messages, trained)
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
        import torch  # Tinker's renderers return torch weights; loaded only when someone asks for them

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


def axolotl_labels(
    conversation: RenderedConversation,
    messages: Sequence[Message],
    roles_to_train: Collection[str],
    train_on_eos: str,
    train_on_inputs: bool,
) -> list[int]:
    """Axolotl's chat_template labels for `conversation.tokens()`: the token id where trained, else -100.

    A message's content is trained when `train_on_inputs` is set or its role is in `roles_to_train`. Its end
    marker (`end`, plus `stop_overlap` after the last message) follows `train_on_eos`: `turn` for trained
    messages, `all` for every message, `last` for the last trained message only, `none` never. BOS, headers and
    the trailer are never trained.
    """
    if train_on_eos not in ("turn", "last", "all", "none"):
        raise RendererError(f"train_on_eos must be turn, last, all or none, not `{train_on_eos}`")
    trained = axolotl_trained(messages, roles_to_train, train_on_inputs)
    ends = [
        rendered.end + (rendered.stop_overlap if index == len(messages) - 1 else [])
        for index, rendered in enumerate(conversation.messages)
    ]
    last_trained_end = max((i for i, end in enumerate(ends) if end and trained[i]), default=None)
    labels = [IGNORE_INDEX] * len(conversation.bos)
    for index, rendered in enumerate(conversation.messages):
        labels += [IGNORE_INDEX] * len(rendered.header)
        labels += rendered.content if trained[index] else [IGNORE_INDEX] * len(rendered.content)
        end_trained = (
            train_on_eos == "all"
            or (train_on_eos == "turn" and trained[index])
            or (train_on_eos == "last" and index == last_trained_end)
        )
        labels += ends[index] if end_trained else [IGNORE_INDEX] * len(ends[index])
    return labels + [IGNORE_INDEX] * len(conversation.trailer)


def axolotl_trained(
    messages: Sequence[Message], roles_to_train: Collection[str], train_on_inputs: bool
) -> list[bool]:
    """Which messages' contents Axolotl trains: all with `train_on_inputs`, else those of `roles_to_train`."""
    return [train_on_inputs or message["role"] in roles_to_train for message in messages]


def split_at_stop_token(
    tokens: Sequence[int], stop_tokens: Collection[int]
) -> tuple[list[int], ParseTermination]:
    """The tokens before the one stop token, and how the response ended; more than one stop is an error
    (the sampler was not given the renderer's stop sequences)."""
    positions = [i for i, token in enumerate(tokens) if token in stop_tokens]
    if len(positions) > 1:
        raise RendererError(
            f"the response has {len(positions)} stop tokens; sample with the renderer's get_stop_sequences()"
        )
    if not positions:
        return list(tokens), ParseTermination.MALFORMED
    return list(tokens[: positions[0]]), ParseTermination.STOP_SEQUENCE


def text_content(message: Message) -> str:
    """The message's text: its string content, or its text parts joined (thinking parts left out)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def thinking_content(message: Message) -> str | None:
    """The reasoning a message carries structurally: its `reasoning_content` string or its thinking parts
    joined; None when it has neither (inline `<think>` text is format-specific and left to the renderer)."""
    if message.get("reasoning_content") is not None:
        return message["reasoning_content"]
    content = message.get("content")
    if isinstance(content, list):
        parts = [part["thinking"] for part in content if part.get("type") == "thinking"]
        if parts:
            return "".join(parts)
    return None


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
