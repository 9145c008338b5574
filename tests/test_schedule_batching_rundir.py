import json

import pytest

from hanzo_gym import files as rundir
from hanzo_gym.data.batching import epoch_order, micro_batches, supervised_datum
from hanzo_gym.data.example import Example
from hanzo_gym.files import publish_directory, publish_files_into
from hanzo_gym.loops.run_dir import RunDir
from hanzo_gym.loops.schedule import lr_at
from hanzo_gym.records import IGNORE_INDEX


def test_warmup_starts_at_zero_then_cosine():
    # HF's warmup: step 0 trains at lr 0, the last warmup step at (warmup - 1) / warmup of the peak.
    lrs = {s: lr_at(s, 110, 1.0, 10, "cosine") for s in (0, 9, 10, 60, 110)}
    assert lrs == pytest.approx({0: 0.0, 9: 0.9, 10: 1.0, 60: 0.5, 110: 0.0}, abs=1e-12)


def test_constant_ignores_warmup_as_hf_does():
    assert lr_at(0, 10, 2.0, 4, "constant") == 2.0
    assert lr_at(0, 10, 2.0, 4, "constant_with_warmup") == 0.0
    assert lr_at(2, 10, 2.0, 4, "constant_with_warmup") == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("kind", "hf_kwargs", "min_lr_ratio"),
    [
        ("cosine", {}, 0.0),
        ("linear", {}, 0.0),
        ("constant", {}, 0.0),
        ("constant_with_warmup", {}, 0.0),
        ("cosine_with_min_lr", {"min_lr_rate": 0.1}, 0.1),
        ("polynomial", {}, 0.0),
        ("inverse_sqrt", {}, 0.0),
        ("cosine_with_restarts", {}, 0.0),
    ],
)
@pytest.mark.parametrize(("total", "warmup"), [(20, 0), (20, 3), (7, 7), (1, 0)])
def test_schedule_matches_transformers_at_every_step(kind, hf_kwargs, min_lr_ratio, total, warmup):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if kind == "polynomial" and total == warmup:
        pytest.skip(
            "HF's polynomial schedule divides by zero when warmup is the whole run (ours ends at 1e-7)"
        )
    peak = 3e-4
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler = transformers.get_scheduler(
        kind,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=total,
        scheduler_specific_kwargs=hf_kwargs,
    )
    for step in range(total + 2):  # two past the end: the schedule stays where HF's does
        # HF's Trainer steps the optimizer with the current lr, then the scheduler.
        assert lr_at(step, total, peak, warmup, kind, min_lr_ratio) == pytest.approx(
            optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-18
        ), step
        optimizer.step()
        scheduler.step()


def test_axolotl_cosine_min_lr_ratio_is_hf_cosine_with_min_lr():
    # Axolotl's `lr_scheduler: cosine` + `cosine_min_lr_ratio` ends at ratio × peak, as HF's cosine_with_min_lr.
    assert lr_at(100, 100, 1.0, 10, "cosine", 0.2) == pytest.approx(0.2)
    assert lr_at(55, 100, 1.0, 10, "cosine", 0.2) == lr_at(55, 100, 1.0, 10, "cosine_with_min_lr", 0.2)
    assert lr_at(55, 100, 1.0, 10, "cosine", 0.2) == pytest.approx(0.6)


@pytest.mark.parametrize(("total", "warmup"), [(20, 0), (20, 3), (100, 10), (7, 7)])
def test_quadratic_warmup_is_axolotls_cosine_with_quadratic_warmup(total, warmup):
    from axolotl.utils.schedulers import _get_cosine_schedule_with_quadratic_warmup_lr_lambda as axolotl

    for step in range(total + 2):
        expected = axolotl(step, num_warmup_steps=warmup, num_training_steps=total, num_cycles=0.5)
        got = lr_at(step, total, 1.0, warmup, "cosine", quadratic_warmup=True)
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-15), step
    if warmup > 1:
        assert lr_at(1, total, 1.0, warmup, "cosine", quadratic_warmup=True) < lr_at(
            1, total, 1.0, warmup, "cosine"
        )


def test_linear():
    assert lr_at(5, 10, 2.0, 0, "linear") == pytest.approx(1.0)
    assert lr_at(10, 10, 2.0, 0, "linear") == pytest.approx(0.0)


def test_epoch_order_is_a_seeded_permutation():
    assert sorted(epoch_order(20, 42, 0)) == list(range(20))
    assert epoch_order(20, 42, 0) == epoch_order(20, 42, 0)
    assert epoch_order(20, 42, 0) != epoch_order(20, 42, 1)


def test_micro_batches_without_and_with_packing():
    lengths = [5, 5, 5, 9, 2, 7]
    order = [0, 1, 2, 3, 4, 5]
    assert micro_batches(lengths, order, 4) == [[0, 1, 2, 3], [4, 5]]
    # rows of at most 10 tokens: [0,1] [2] [3] [4,5]; two rows per micro-batch
    assert micro_batches(lengths, order, 2, pack_to=10) == [[0, 1, 2], [3, 4, 5]]
    # an example longer than the pack length still gets a row of its own
    assert micro_batches([12, 3], [0, 1], 1, pack_to=10) == [[0], [1]]


def test_supervised_datum_shifts_labels():
    example = Example([10, 11, 12, 13], [IGNORE_INDEX, IGNORE_INDEX, 12, 13])
    datum = supervised_datum(example, 0.5)
    assert datum.model_input.to_ints() == [10, 11, 12]
    inputs = {key: value.tolist() for key, value in datum.loss_fn_inputs.items()}
    assert inputs == {"target_tokens": [11, 12, 13], "weights": [0.0, 0.5, 0.5]}


def test_publish_directory_is_all_or_nothing(tmp_path):
    final = tmp_path / "checkpoint-1"

    def crash(directory):
        (directory / "half").write_text("x")
        raise RuntimeError("disk died")

    with pytest.raises(RuntimeError):
        publish_directory(crash, final)
    assert list(tmp_path.iterdir()) == []

    publish_directory(lambda d: (d / "a").write_text("1"), final)
    publish_directory(lambda d: (d / "b").write_text("2"), final)
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_publishing_files_moves_the_marker_last(tmp_path, monkeypatch):
    (tmp_path / "adapter_config.json").write_text("old run")
    (tmp_path / "adapter_model.safetensors").write_text("old weights")

    def build(directory):
        for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json"):
            (directory / name).write_text("new")

    moved = []
    real_replace = rundir.os.replace

    def crash_after_two(source, destination):
        if len(moved) == 2:
            raise OSError("killed")
        moved.append(destination.name)
        real_replace(source, destination)

    monkeypatch.setattr(rundir.os, "replace", crash_after_two)
    with pytest.raises(OSError):
        publish_files_into(build, tmp_path, marker="adapter_config.json")
    # Killed part-way: new weights, but no adapter_config.json to vouch for a mix of old and new files.
    assert "adapter_config.json" not in moved and not (tmp_path / "adapter_config.json").exists()
    monkeypatch.setattr(rundir.os, "replace", real_replace)
    publish_files_into(build, tmp_path, marker="adapter_config.json")
    assert (tmp_path / "adapter_config.json").read_text() == "new"


def test_run_dir_records_and_forgets(tmp_path):
    run = RunDir(tmp_path / "run")
    for step in (1, 2, 3):
        run.log({"step": step, "loss": 1.0 / step})
    run.save_checkpoint(2, 0.5, lambda d: (d / "trainer_state.json").write_text("{}"))
    (run.path / "checkpoint-9").mkdir()  # no trainer_state.json: incomplete, never trusted
    assert run.latest_checkpoint() == run.path / "checkpoint-2"
    records = [json.loads(x) for x in run.checkpoints_path.read_text().splitlines()]
    assert records == [
        {"name": "checkpoint-2", "step": 2, "epoch": 0.5, "path": str(run.path / "checkpoint-2")}
    ]
    run.forget_after(2)
    assert [row["step"] for row in run.metrics()] == [1, 2]
    with open(run.metrics_path, "a") as handle:
        handle.write('{"step": 3, "lo')  # torn line from a crash
    assert [row["step"] for row in run.metrics()] == [1, 2]
