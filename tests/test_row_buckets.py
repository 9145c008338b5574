"""Packed rows in bf16 on a CPU are padded to a few lengths: the real positions score as unpadded, the decoder
sees only bucket lengths, and the per-shape kernels oneDNN and torch's CPU attention keep stop piling up."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_lora_engine

from hanzo_gym.engine.row_buckets import bucket_length, pads_rows
from hanzo_gym.records import Datum, ModelInput


def _datum(tokens: list[int]) -> Datum:
    return Datum(
        ModelInput.from_ints(tokens[:-1]), {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}
    )


def _random_tokens(generator: torch.Generator, length: int) -> list[int]:
    return torch.randint(3, 96, (length,), generator=generator).tolist()


def test_bucket_lengths_pad_at_most_an_eighth():
    assert [bucket_length(n) for n in (1, 16, 17, 100, 128, 129, 176, 177, 1000, 1025)] == [
        16, 16, 32, 112, 128, 144, 176, 192, 1024, 1152,
    ]  # fmt: skip
    for n in range(128, 5000):  # below 128 rows round to a multiple of 16
        assert n <= bucket_length(n) <= n * 1.125
    assert len({bucket_length(n) for n in range(257, 513)}) == 8  # 288, 320, ..., 512


def test_only_low_precision_on_a_cpu_pads():
    decoder = torch.nn.Linear(2, 2)
    cpu = torch.device("cpu")
    assert not pads_rows(decoder, cpu, None)
    assert pads_rows(decoder, cpu, torch.bfloat16)  # autocast over fp32 weights
    assert pads_rows(decoder.to(torch.bfloat16), cpu, None)
    assert not pads_rows(decoder, torch.device("cuda"), torch.bfloat16)
    assert tiny_lora_engine(torch.bfloat16)._pads_rows and not tiny_lora_engine(torch.float32)._pads_rows


def _layouts() -> dict[str, list[Datum]]:
    generator = torch.Generator().manual_seed(3)
    prompt = _random_tokens(generator, 20)
    return {
        "packed": [_datum(_random_tokens(generator, n)) for n in (41, 34, 28)],  # 100 positions: 12 pads
        "shared prompt": [_datum(prompt + _random_tokens(generator, n)) for n in (5, 9, 3)],
        "lone": [_datum(_random_tokens(generator, 41))],
    }


@pytest.mark.parametrize("layout", ["packed", "shared prompt", "lone"])
def test_padded_rows_score_and_train_as_unpadded(layout):
    datums = _layouts()[layout]
    results = {}
    for pads in (False, True):
        engine = tiny_lora_engine(torch.bfloat16)
        engine._pads_rows = pads
        lengths = []
        engine._decoder.register_forward_pre_hook(
            lambda _, args, kwargs, seen=lengths: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        )
        out = engine.forward_backward(datums)
        grads = torch.cat([p.grad.flatten() for p in engine.trainable])
        results[pads] = (torch.cat(out.logprobs), grads, out.loss_sum, lengths)
    (plain, plain_grads, plain_loss, plain_lengths), (padded, padded_grads, padded_loss, padded_lengths) = (
        results[False],
        results[True],
    )
    assert padded_lengths == [bucket_length(n) for n in plain_lengths]
    assert padded_lengths != plain_lengths  # these rows are not bucket lengths already: padding happened
    if layout == "lone":
        # An unpadded lone datum takes attention's causal path, a padded one the masked path: bf16 rounding
        # apart (measured max |Δ| 0.0044, gradient 0.7 % relative); a real token reading a pad would be far off.
        assert (padded - plain).abs().max().item() < 0.02
        assert ((padded_grads - plain_grads).norm() / plain_grads.norm()).item() < 0.03
    else:
        # The same masked attention either way: equal scores (measured bit for bit), gradients within the
        # rounding of bf16 sums taken over a longer row (measured 0.12 % relative)
        torch.testing.assert_close(padded, plain, atol=1e-6, rtol=0)
        assert ((padded_grads - plain_grads).norm() / plain_grads.norm()).item() < 0.01
    assert padded_loss == pytest.approx(plain_loss, rel=1e-3)


KERNEL_GROWTH_PROBE = textwrap.dedent(
    """
    import ctypes, random, sys, torch
    sys.path.insert(0, sys.argv[2])
    from tiny_models import tiny_model
    from hanzo_gym.engine import Engine
    from hanzo_gym.model.lora import attach_lora
    from hanzo_gym.records import Datum, ModelInput

    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 1e6

    torch.manual_seed(0)
    model = tiny_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4).to(torch.bfloat16)
    engine = Engine(
        attach_lora(model, r=8, alpha=16, dropout=0.0, target_modules="all-linear", base_model_name="tiny")
    )
    engine._pads_rows = sys.argv[1] == "padded"

    def datum(n):
        return Datum(ModelInput.from_ints([5] * n), {"target_tokens": [6] * n, "weights": [1.0] * n})

    engine.forward_backward([datum(40), datum(41)])
    before = rss_mb()
    lengths = list(range(60, 200))
    random.Random(0).shuffle(lengths)
    for n in lengths:
        engine.forward_backward([datum(n), datum(7)])
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what stays is held, not free memory the allocator kept
    print(rss_mb() - before)
    """
)


@pytest.mark.slow
def test_padding_bounds_what_bf16_kernels_keep_per_row_length():
    """140 distinct row lengths: unpadded, oneDNN's matmul primitives and torch's CPU attention kernels for
    each stay (measured 773 MB on this 4-layer model; fp32 none); padded to 9 lengths, 310 MB."""
    tests_dir = str(Path(__file__).parent)

    def growth_mb(mode: str) -> float:
        run = subprocess.run(
            [sys.executable, "-c", KERNEL_GROWTH_PROBE, mode, tests_dir],
            capture_output=True,
            text=True,
            check=True,
        )
        return float(run.stdout.split()[-1])

    unpadded, padded = growth_mb("unpadded"), growth_mb("padded")
    assert unpadded > 300
    assert padded < 0.6 * unpadded
    assert len({bucket_length(n + 7) for n in range(60, 200)}) == 9
