"""One engine state API and one on-disk format for `gym train` checkpoints and the Tinker client's states."""

from __future__ import annotations

import pathlib

import pytest
import torch
from tiny_models import tiny_model

from hanzo_gym import tinker
from hanzo_gym.engine import Engine
from hanzo_gym.engine.state_files import (
    LEGACY_CLIENT_FILE,
    LEGACY_TRAINER_FILE,
    OPTIMIZER_FILE,
    load_engine_state,
    read_optimizer_state,
    save_engine_state,
)
from hanzo_gym.errors import GymError
from hanzo_gym.loops.checkpoint import TrainerPosition, write_checkpoint
from hanzo_gym.model.lora import attach_lora, write_adapter
from hanzo_gym.records import AdamParams, Datum, ModelInput
from hanzo_gym.tinker.paths import resolve

ADAM = AdamParams(learning_rate=3e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.01)
SEQUENCES = [[3, 8, 9, 12, 13, 14, 15], [3, 20, 21, 22, 23], [3, 30, 31, 32, 33, 34]]


def _engine(seed: int) -> Engine:
    """The same tiny base every time; `seed` draws the adapter's initial A matrices."""
    torch.manual_seed(0)
    base = tiny_model("llama")
    torch.manual_seed(seed)
    model = attach_lora(base, r=4, alpha=8, dropout=0.0, target_modules="all-linear", base_model_name="tiny")
    return Engine(model)


def _datums() -> list[Datum]:
    return [
        Datum(ModelInput.from_ints(s[:-1]), {"target_tokens": s[1:], "weights": [0.1] * (len(s) - 1)})
        for s in SEQUENCES
    ]


def _step(engine: Engine) -> float:
    loss = engine.forward_backward(_datums()).loss_sum
    engine.optim_step(ADAM)
    return loss


def _weights(engine: Engine) -> dict[str, torch.Tensor]:
    return engine.state_dict()["adapter"]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        torch.testing.assert_close(value, b[key], rtol=0, atol=0)


def test_state_dict_carries_training_on_exactly():
    original = _engine(0)
    for _ in range(3):
        _step(original)
    other = _engine(1)  # another initial adapter: everything it ends with comes from the state
    other.load_state_dict(original.state_dict())
    _assert_same(_weights(other), _weights(original))
    assert _step(other) == _step(original)
    _assert_same(_weights(other), _weights(original))


def test_without_optimizer_state_training_restarts_the_moments():
    original = _engine(0)
    for _ in range(2):
        _step(original)
    weights_only = _engine(1)
    weights_only.load_state_dict({"adapter": original.state_dict()["adapter"]})
    assert weights_only.optimizer.state_dict()["state"] == {}
    reset = _engine(2)
    reset.load_state_dict(original.state_dict())
    reset.reset_optimizer()
    _step(weights_only)
    _step(reset)
    _assert_same(_weights(weights_only), _weights(reset))  # a fresh AdamW from the same weights


def test_forward_loss_is_forward_backwards_loss_without_gradients():
    engine = _engine(0)
    scored = engine.forward_loss(_datums(), "cross_entropy")
    assert all(p.grad is None for p in engine.trainable)
    trained = engine.forward_backward(_datums(), "cross_entropy")
    assert scored.loss_sum == pytest.approx(trained.loss_sum, rel=1e-6)
    for a, b in zip(scored.logprobs, trained.logprobs):
        torch.testing.assert_close(a, b)


def test_the_files_round_trip_the_state_and_hold_no_pickle(tmp_path):
    original = _engine(0)
    _step(original)
    save_engine_state(original, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        OPTIMIZER_FILE,
    ]
    restored = _engine(5)
    load_engine_state(restored, tmp_path)
    assert _step(restored) == _step(original)
    _assert_same(_weights(restored), _weights(original))


def test_a_checkpoint_of_the_old_format_still_resumes(tmp_path):
    """`gym train` checkpoints before the shared format kept the optimizer in training_state.pt."""
    original = _engine(0)
    _step(original)
    state = original.state_dict()
    write_adapter(tmp_path, original.adapter_config, state["adapter"])
    torch.save(
        {"optimizer": state["optimizer"], "cpu_rng": torch.get_rng_state(), "cuda_rng": None},
        tmp_path / LEGACY_TRAINER_FILE,
    )
    restored = _engine(5)
    load_engine_state(restored, tmp_path)
    assert _step(restored) == _step(original)


class _RunsCode:
    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_a_state_file_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"optimizer": _RunsCode(marker)}, tmp_path / LEGACY_TRAINER_FILE)
    with pytest.raises(GymError, match="refused: it holds more than tensors"):
        read_optimizer_state(tmp_path)
    assert not marker.exists()


def test_a_gym_train_checkpoint_is_a_tinker_state_and_back(tmp_path, tiny_dir):
    """The YAML loop's checkpoint folder loads as a Tinker training state with its optimizer, and the two
    then train identically; a Tinker save_state has the same files."""
    datums = _datums()  # records.Datum is tinker.types.Datum
    adam = tinker.types.AdamParams(learning_rate=3e-2)
    with tinker.ServiceClient(root=tmp_path / "runs", dtype=torch.float32) as service:
        first = service.create_lora_training_client(base_model=tiny_dir, rank=4, seed=0)
        first.forward_backward(datums, "cross_entropy").result()
        first.optim_step(adam).result()
        checkpoint = tmp_path / "checkpoint-1"
        checkpoint.mkdir()
        with first._host.using(first._adapter):
            write_checkpoint(checkpoint, first._engine, TrainerPosition(step=1, epoch=0, window=1, plan={}))
        second = service.create_training_client_from_state_with_optimizer(str(checkpoint))
        losses = []
        for client in (first, second):
            losses.append(client.forward_backward(datums, "cross_entropy").result().metrics["loss:sum"])
            client.optim_step(adam).result()
        assert losses[0] == losses[1]
        _assert_same(first._host.weights(first._adapter), second._host.weights(second._adapter))
        tinker_state = resolve(second.save_state("after").result().path, service.root)
    assert (tinker_state / OPTIMIZER_FILE).is_file() and not list(tinker_state.glob("*.pt"))


def test_a_tinker_state_of_the_old_format_still_loads_with_its_optimizer(tmp_path):
    """The Tinker client kept the optimizer alone in optimizer.pt before the shared format."""
    original = _engine(0)
    _step(original)
    state = original.state_dict()
    write_adapter(tmp_path, original.adapter_config, state["adapter"])
    torch.save(state["optimizer"], tmp_path / LEGACY_CLIENT_FILE)
    restored = _engine(5)
    load_engine_state(restored, tmp_path)
    assert _step(restored) == _step(original)
    _assert_same(_weights(restored), _weights(original))
