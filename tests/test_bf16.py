"""bf16: which precision `bf16: auto` picks, the mixed recipe (frozen base in bf16, adapter and AdamW state in fp32,
log-probabilities and losses reduced in fp32), and numerics against the fp32 reference.

Tolerances are set between two measurements: the error of the right implementation and the error of a wrong one
(reductions in bf16, an adapter in bf16), each named next to its check. Where a whole model runs in bf16 the
rounding of its activations (8 significant bits) dominates every other error, so those checks guard against
gross mistakes (the adapter branch lost, a bf16 overflow) and the unit checks below them tell right from wrong.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import save_tiny_word_model
from tiny_models import tiny_lora_engine

from hanzo_gym.cli import main
from hanzo_gym.config import parse_config
from hanzo_gym.engine import Engine
from hanzo_gym.engine.decoding import decoding
from hanzo_gym.engine.token_logprobs import token_logprobs
from hanzo_gym.loops.train import build_engine
from hanzo_gym.model import hub
from hanzo_gym.model.load_plan import BaseModelPlan, LoadPlan
from hanzo_gym.model.lora import attach_lora
from hanzo_gym.records import AdamParams, Datum, ModelInput, SamplingParams


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def cpu_with_bf16(monkeypatch, cpu_only):
    monkeypatch.setattr(hub, "cpu_native_bf16", lambda: "avx512_bf16")


@pytest.fixture
def cpu_without_bf16(monkeypatch, cpu_only):
    monkeypatch.setattr(hub, "cpu_native_bf16", lambda: None)


# ---- what `bf16: auto` chooses ---------------------------------------------------------------------------------


def test_auto_is_bf16_on_a_cpu_that_multiplies_bf16_natively(cpu_with_bf16):
    precision = hub.choose_precision("auto")
    assert (precision.device.type, precision.dtype) == ("cpu", torch.bfloat16)
    assert precision.describe() == "precision: bf16 (CPU has avx512_bf16)"
    assert hub.choose_precision(False).describe() == "precision: fp32 (bf16: false)"


def test_auto_stays_fp32_on_a_cpu_without_native_bf16(cpu_without_bf16):
    precision = hub.choose_precision("auto")
    assert precision.dtype == torch.float32
    assert precision.describe() == "precision: fp32 (CPU has neither avx512_bf16 nor amx_bf16)"
    forced = hub.choose_precision(True)
    assert forced.dtype == torch.bfloat16 and "emulated and slow" in forced.describe()


@pytest.mark.parametrize(("native", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_cuda_asks_whether_the_device_has_native_bf16(monkeypatch, native, dtype):
    asked = {}

    def is_bf16_supported(including_emulation=True):
        asked["including_emulation"] = including_emulation
        return native

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    precision = hub.choose_precision("auto")
    assert (precision.device, precision.dtype) == (torch.device("cuda", 0), dtype)
    assert asked == {"including_emulation": False}  # an emulated bf16 (pre-Ampere) is slower than fp32
    assert "CUDA device Tesla T4" in precision.reason


def test_the_cpu_check_reads_torch_and_falls_back_to_cpuinfo(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": False, "amx_bf16": False})
    assert hub.cpu_native_bf16() is None
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True, "amx_bf16": True})
    assert hub.cpu_native_bf16() == "amx_bf16"
    monkeypatch.delattr(torch.cpu, "get_capabilities")  # an older torch
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n")
    monkeypatch.setattr(hub, "CPUINFO", cpuinfo)
    assert hub.cpu_native_bf16() == "avx512_bf16"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
    assert hub.cpu_native_bf16() is None
    monkeypatch.setattr(hub, "CPUINFO", tmp_path / "absent")
    assert hub.cpu_native_bf16() is None


# ---- gym train: the first line, and a run in each precision ----------------------------------------------------


@pytest.fixture(scope="module")
def word_base(tmp_path_factory, word_tokenizer):
    return save_tiny_word_model(tmp_path_factory.mktemp("tiny-word"), word_tokenizer, hidden_size=64)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "train.jsonl"
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
    with open(path, "w") as handle:
        for word in words:
            messages = [
                {"role": "user", "content": f"how are you {word}"},
                {"role": "assistant", "content": f"I am well {word} thanks"},
            ]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path


def _run_config(base, data, output_dir, **overrides) -> dict:
    return {
        "base_model": str(base),
        "datasets": [{"path": str(data), "type": "chat_template"}],
        "output_dir": str(output_dir),
        "adapter": "lora",
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "lora_target_linear": True,
        "micro_batch_size": 4,
        "num_epochs": 4,
        "learning_rate": 5e-3,
        "logging_steps": 1,
        "sequence_len": 64,
        "seed": 3,
        **overrides,
    }


def _losses(run) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def _train(tmp_path, name, base, data, capsys, **overrides) -> tuple[str, list[float]]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_run_config(base, data, tmp_path / name, **overrides)))
    capsys.readouterr()
    assert main(["train", str(path)]) == 0
    return capsys.readouterr().out.splitlines()[0], _losses(tmp_path / name)


def test_gym_train_says_first_which_precision_it_chose_and_bf16_tracks_fp32(
    tmp_path, word_base, chats, capsys, cpu_with_bf16
):
    first, bf16_losses = _train(tmp_path, "auto", word_base, chats, capsys)
    assert first == "precision: bf16 (CPU has avx512_bf16)"
    first, fp32_losses = _train(tmp_path, "fp32", word_base, chats, capsys, bf16=False)
    assert first == "precision: fp32 (bf16: false)"
    assert len(bf16_losses) == len(fp32_losses) == 8 and bf16_losses[-1] < 0.7 * bf16_losses[0]
    # 8 steps at lr 5e-3 on the same data and seed: measured at most 0.9 % apart step by step (bf16 rounding
    # compounding through the updates); 5 % is the bar for the real model's eval loss.
    for bf16_loss, fp32_loss in zip(bf16_losses, fp32_losses):
        assert bf16_loss == pytest.approx(fp32_loss, rel=0.05)


def test_gym_train_keeps_fp32_on_a_cpu_without_native_bf16(
    tmp_path, word_base, chats, capsys, cpu_without_bf16
):
    first, losses = _train(tmp_path, "auto", word_base, chats, capsys, num_epochs=1)
    assert first == "precision: fp32 (CPU has neither avx512_bf16 nor amx_bf16)"
    assert len(losses) == 2


# ---- the mixed recipe ------------------------------------------------------------------------------------------


def _datums() -> list[Datum]:
    generator = torch.Generator().manual_seed(2)
    datums = []
    for length in (40, 33, 27):
        ids = torch.randint(3, 96, (length + 1,), generator=generator).tolist()
        datums.append(
            Datum(ModelInput.from_ints(ids[:-1]), {"target_tokens": ids[1:], "weights": [1.0] * length})
        )
    return datums


def test_a_bf16_base_trains_an_fp32_adapter_with_fp32_adamw_state():
    engine = tiny_lora_engine(torch.bfloat16)
    frozen = [p for p in engine.model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert engine.trainable and all(p.dtype == torch.float32 for p in engine.trainable)
    before = [p.detach().clone() for p in engine.trainable]
    engine.forward_backward(_datums())
    assert all(p.grad.dtype == torch.float32 for p in engine.trainable)
    lr = 1e-5
    engine.optim_step(AdamParams(learning_rate=lr, weight_decay=0.0))
    moments = [t for state in engine.optimizer.state.values() for t in state.values() if t.numel() > 1]
    assert moments and all(t.dtype == torch.float32 for t in moments)
    # AdamW's first step moves every parameter with a gradient by lr (m / sqrt(v) = ±1). Measured: the fp32
    # adapter moves by lr within 0.01 %, every entry; a bf16 adapter (8 significant bits: entries about 0.08 in
    # size are 3e-4 apart) rounds the 1e-5 step away for 96 % of its entries, its mean step 0.05 lr: 95 % off.
    # Allowed: 1 %.
    steps = torch.cat([(p.detach() - b).abs().flatten() for p, b in zip(engine.trainable, before)])
    moved = steps[steps > 0]
    assert moved.numel() > 0.9 * steps.numel()
    assert moved.mean().item() == pytest.approx(lr, rel=0.01)


def test_lora_on_a_bf16_base_matches_the_fp32_reference():
    datums = _datums()
    reference, mixed = tiny_lora_engine(torch.float32), tiny_lora_engine(torch.bfloat16)
    assert (reference.autocast_dtype, mixed.autocast_dtype) == (None, torch.bfloat16)
    want, got = reference.forward_backward(datums), mixed.forward_backward(datums)
    want_N, got_N = torch.cat(want.logprobs), torch.cat(got.logprobs)
    assert got_N.dtype == torch.float32
    # Measured on these 100 tokens, the LoRA matmuls in bf16 under autocast over the fp32 adapter (the engine's
    # default over a bf16 base): mean |Δ logprob| 0.014 (max 0.050), loss 1e-5 relative, gradient 3.1 %
    # relative (L2): the rounding of a bf16 network's activations. PEFT's fp32 LoRA branch measured 0.012 (max
    # 0.039), a bf16 adapter 0.014 and bf16 reductions 0.018: not told apart at this level (the unit checks
    # around this one do); the bounds catch a lost adapter branch (mean |Δ| 0.39 here) or a bf16 overflow.
    assert (want_N - got_N).abs().mean().item() < 0.025
    assert got.loss_sum == pytest.approx(want.loss_sum, rel=1e-3)
    want_grad = torch.cat([p.grad.flatten() for p in reference.trainable])
    got_grad = torch.cat([p.grad.flatten() for p in mixed.trainable])
    assert ((got_grad - want_grad).norm() / want_grad.norm()).item() < 0.06


def test_log_probabilities_of_bf16_activations_are_reduced_in_fp32():
    """The output projection's matmul runs in bf16; the log-sum-exp over the vocabulary, the picked logit and
    the loss sum run in fp32. Reference: the same bf16 inputs in fp64."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(256, 64, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(4096, 64, generator=generator) / 8).bfloat16()
    targets = torch.randint(0, 4096, (256,), generator=generator)
    logprobs, entropy = token_logprobs(hidden, weight, targets, chunk=100)
    assert logprobs.dtype == entropy.dtype == torch.float32
    exact_logits = hidden.detach().double() @ weight.double().T
    exact = torch.log_softmax(exact_logits, -1).gather(1, targets[:, None]).squeeze(1)
    # Measured: mean |error| 0.0012 (only the logits' rounding to bf16); reduced in bf16 (logsumexp and the
    # subtraction on bf16 logits) 0.023, a bf16 log_softmax 0.016. Allowed: 0.005.
    assert (logprobs.double() - exact).abs().mean().item() < 0.005
    # The sum over 256 tokens (about -2270): measured 0.024 off; summed in bf16 4.1 off. Allowed: 0.5.
    assert abs(logprobs.double().sum() - exact.sum()).item() < 0.5
    logprobs.sum().backward()
    exact_hidden = hidden.detach().double().requires_grad_()
    torch.log_softmax(exact_hidden @ weight.double().T, -1).gather(1, targets[:, None]).sum().backward()
    error = (hidden.grad.double() - exact_hidden.grad).norm() / exact_hidden.grad.norm()
    assert hidden.grad.dtype == torch.bfloat16 and error.item() < 0.01  # measured 0.0017 (bf16 rounding)


def test_decoding_keeps_the_adapter_branch_on_a_bf16_base():
    """Folding ΔW into bf16 weights would round a young adapter's update away: the sampler would decode the
    base model. An fp32 base is still folded (faster on CPU, and exact enough)."""
    from peft.tuners.lora import LoraLayer

    for dtype, folded in ((torch.bfloat16, False), (torch.float32, True)):
        engine = tiny_lora_engine(dtype)
        layers = [m for m in engine.model.modules() if isinstance(m, LoraLayer)]
        weights = [m.get_base_layer().weight for m in layers]
        factors = [m.lora_A["default"].weight for m in layers]
        with decoding(engine.model):
            swapped = [m.get_base_layer().weight is not w for m, w in zip(layers, weights)]
            disabled = [m.disable_adapters for m in layers]
            # unfolded, the branch computes in the base's dtype while decoding (no casts of every input)
            branch = {m.lora_A["default"].weight.dtype for m in layers} | {
                m.lora_B["default"].weight.dtype for m in layers
            }
        assert all(swapped) == folded and all(disabled) == folded and any(swapped) == folded
        assert folded or branch == {torch.bfloat16}
        assert all(
            m.lora_A["default"].weight is f and f.dtype == torch.float32 for m, f in zip(layers, factors)
        )


def test_sampled_logprobs_match_recomputed_ones_in_bf16_on_a_tiny_model():
    from hanzo_gym.engine.sampling import sample_groups

    engine = tiny_lora_engine(torch.bfloat16)

    class Tokenizer:  # what the sampler reads of a tokenizer when there are no stop strings
        eos_token_id = 2
        pad_token_id = 0

    prompts = [[1, 5, 9, 14, 20], [1, 30, 31]]
    groups = sample_groups(engine.model, Tokenizer(), prompts, 3, SamplingParams(max_tokens=12, seed=0))
    diffs = []
    for prompt, group in zip(prompts, groups):
        for sequence in group:
            # the trainer's recomputation (what optim/kl_sample_train_v1 compares against): the engine's pass
            full = prompt + sequence.tokens
            scored = engine.forward([Datum(ModelInput.from_ints(full[:-1]), {"target_tokens": full[1:]})])[0]
            diffs.append(torch.tensor(sequence.logprobs) - scored[-len(sequence.tokens) :])
    diffs = torch.cat(diffs)
    # Measured against the engine's pass: mean 0.0002, mean |Δ| 0.0053 (bf16 rounding differs between a cached
    # decode step and a full pass) with the adapter branch in bf16 while decoding, as the trainer's autocast
    # computes it; 0.0089 with PEFT's fp32 branch (the sampler before); with ΔW folded into the bf16 weights,
    # 0.014 against a plain pass (0.014 too with B 25 times smaller: the rounding of W + ΔW, whatever ΔW's
    # size). Allowed: 0.007.
    assert abs(diffs.mean().item()) < 0.01 and diffs.abs().mean().item() < 0.007


def test_qlora_computes_in_the_runs_dtype(tmp_path, word_base, chats, word_tokenizer):
    from bitsandbytes.nn import Linear4bit

    cfg = parse_config(
        _run_config(word_base, chats, tmp_path / "unused", adapter="qlora", load_in_4bit=True, bf16=True)
    )
    engine = build_engine(cfg, LoadPlan.from_config(cfg, torch.device("cpu"), torch.bfloat16), word_tokenizer)
    quantized = [m for m in engine.model.modules() if isinstance(m, Linear4bit)]
    assert quantized and all(m.compute_dtype == torch.bfloat16 for m in quantized)
    assert all(p.dtype == torch.float32 for p in engine.trainable)
    out = engine.forward_backward(_word_datums())
    assert torch.isfinite(torch.cat(out.logprobs)).all() and all(p.grad is not None for p in engine.trainable)


def _word_datums() -> list[Datum]:
    ids = [1, 8, 9, 12, 13, 14, 20, 21, 22, 2]
    return [Datum(ModelInput.from_ints(ids[:-1]), {"target_tokens": ids[1:], "weights": [1.0] * 9})]


# ---- the real model ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_engines(converted_real_model):
    """SmolLM2-135M in fp32 and in bf16, with the same small non-zero adapter (what a few steps of training
    leave: B about 2e-3)."""
    model_dir = str(converted_real_model.model_dir)
    tokenizer = hub.load_tokenizer(model_dir)
    engines = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = attach_lora(
            hub.load_causal_lm(BaseModelPlan.of(model_dir, dtype)),
            r=8,
            alpha=16,
            dropout=0.0,
            target_modules="all-linear",
            base_model_name=model_dir,
        )
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 2e-3)
        engines[dtype] = Engine(model, tokenizer)
    return tokenizer, engines


@pytest.mark.real_model
def test_real_model_bf16_scores_and_gradients_match_fp32(real_engines):
    tokenizer, engines = real_engines
    text = (
        "In 1905, Albert Einstein published four papers that changed physics: on the photoelectric effect, "
        "Brownian motion, special relativity and the equivalence of mass and energy. "
    ) * 2
    ids = tokenizer(text)["input_ids"][:96]
    datum = Datum(
        ModelInput.from_ints(ids[:-1]), {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}
    )
    for engine in engines.values():
        engine.optimizer.zero_grad(set_to_none=True)
    want, got = (
        engines[torch.float32].forward_backward([datum]),
        engines[torch.bfloat16].forward_backward([datum]),
    )
    # Measured: loss 0.2 % apart, mean |Δ logprob| 0.041, gradient 6 % relative (cosine 0.998).
    assert got.loss_sum == pytest.approx(want.loss_sum, rel=0.01)
    assert (torch.cat(want.logprobs) - torch.cat(got.logprobs)).abs().mean().item() < 0.1
    want_grad = torch.cat([p.grad.flatten() for p in engines[torch.float32].trainable])
    got_grad = torch.cat([p.grad.flatten() for p in engines[torch.bfloat16].trainable])
    assert torch.nn.functional.cosine_similarity(want_grad, got_grad, dim=0).item() > 0.99


@pytest.mark.real_model
def test_real_model_bf16_sampler_matches_the_trainer(real_engines):
    """optim/kl_sample_train_v1 (the mean of sampler minus trainer logprobs over completion tokens) below 0.01
    in bf16, as in GRPO."""
    tokenizer, engines = real_engines
    engine = engines[torch.bfloat16]
    questions = ["What is 17 + 25?", "Name a colour of the sky."]
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    prompts = [tokenizer(chat, add_special_tokens=False)["input_ids"] for chat in chats]
    groups = engine.sample(prompts, 4, SamplingParams(max_tokens=32, temperature=1.0, seed=0))
    diffs = []
    for prompt, group in zip(prompts, groups):
        for sequence in group:
            full = prompt + sequence.tokens
            [trained] = engine.forward([Datum(ModelInput.from_ints(full[:-1]), {"target_tokens": full[1:]})])
            diffs.append(torch.tensor(sequence.logprobs) - trained[-len(sequence.tokens) :])
    diffs = torch.cat(diffs)
    # Measured: v1 0.0015 with the adapter branch kept (0.0048 with ΔW folded into the bf16 weights); mean
    # |Δ| 0.043, bf16's own rounding differing between a cached decode step and a full pass (fp32: 0.0000).
    assert abs(diffs.mean().item()) < 0.01
    assert diffs.abs().mean().item() < 0.1


# ---- the Tinker client and gym serve ---------------------------------------------------------------------------


def _tinker_loss(service, base: str) -> tuple[float, object]:
    from hanzo_gym.tinker import types

    client = service.create_lora_training_client(base, rank=4, seed=3)
    tokens = list(range(3, 40))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    return client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"], client


def test_the_tinker_client_and_gym_serve_compute_in_bf16_where_the_cpu_multiplies_it(
    cpu_with_bf16, tmp_path, tiny_dir
):
    from hanzo_gym import tinker
    from hanzo_gym.host.model_host import ModelHost

    host = ModelHost(tiny_dir)  # gym serve's, with --bf16 auto
    assert host.precision.describe() == "precision: bf16 (CPU has avx512_bf16)"
    assert {p.dtype for p in host.model.parameters()} == {torch.bfloat16}
    with (
        tinker.ServiceClient(root=tmp_path / "a") as mixed,
        tinker.ServiceClient(root=tmp_path / "b", dtype=torch.float32) as fp32,
    ):
        got, client = _tinker_loss(mixed, tiny_dir)
        want, _ = _tinker_loss(fp32, tiny_dir)
        adapter = [p for p in client._host.model.parameters() if p.requires_grad]
        assert adapter and {p.dtype for p in adapter} == {torch.float32}  # the mixed recipe, as gym train's
        assert got != want and got == pytest.approx(want, rel=1e-2)  # bf16 activations, fp32 reductions
        sampler = client.save_weights_and_get_sampling_client("w")
        sampled = sampler.sample(
            tinker.types.ModelInput.from_ints([3, 4, 5]),
            1,
            tinker.types.SamplingParams(max_tokens=4, seed=0, stop=[]),
        ).result()
        assert len(sampled.sequences[0].tokens) == 4


def test_the_tinker_client_and_gym_serve_stay_fp32_on_a_cpu_without_native_bf16(cpu_without_bf16, tiny_dir):
    from hanzo_gym.host.model_host import ModelHost

    host = ModelHost(tiny_dir)
    assert host.precision.describe() == "precision: fp32 (CPU has neither avx512_bf16 nor amx_bf16)"
    assert ModelHost(tiny_dir, dtype=torch.bfloat16).precision.describe() == "precision: bf16 (as asked)"


def test_checkpointed_layers_recompute_in_the_forwards_dtypes_under_autocast():
    """torch recomputes a checkpointed layer under the forward's autocast state; the LoRA layers' input casting
    must follow it, or the recomputed tensors' dtypes differ from the forward's and the backward pass fails."""
    datums = _datums()
    plain, checkpointed = tiny_lora_engine(torch.bfloat16), tiny_lora_engine(torch.bfloat16)
    checkpointed.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain.forward_backward(datums)
    checkpointed.forward_backward(datums)
    for want, got in zip(plain.trainable, checkpointed.trainable, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)  # the same bf16 ops, recomputed
