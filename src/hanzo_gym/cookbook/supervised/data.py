"""`tinker_cookbook.supervised.data.conversation_to_datum`: one conversation → one training Datum."""

from __future__ import annotations

from collections.abc import Sequence

from hanzo_gym.records import ModelInput
from hanzo_gym.renderers import Message, Renderer, TrainOnWhat
from hanzo_gym.tinker.types import Datum


def conversation_to_datum(
    messages: Sequence[Message],
    renderer: Renderer,
    max_length: int | None,
    train_on_what: TrainOnWhat | str = TrainOnWhat.ALL_ASSISTANT_MESSAGES,
) -> Datum:
    """Render, cut to `max_length` tokens, and shift: input = tokens[:-1], target = tokens[1:], weights
    aligned with the targets."""
    model_input, weights = renderer.build_supervised_example(messages, train_on_what=train_on_what)
    tokens = model_input.to_ints()
    weights = weights.tolist()
    if max_length is not None:
        tokens, weights = tokens[:max_length], weights[:max_length]
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
    )
