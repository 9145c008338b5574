"""vLLM rollouts without vLLM: the keys and their rules, the `gym vllm-serve` command line, the policy's merged
weights (checked against peft's own merge) and the request fields. What needs vLLM itself is in
tests/test_vllm_rollouts.py, run in its own environment (`make test-vllm`)."""

from __future__ import annotations

import sys

import pytest
import torch
from config_files import error_of, load_text
from peft import LoraConfig, get_peft_model
from tiny_models import tiny_model

from hanzo_gym.cli.vllm_serve import vllm_serve_command
from hanzo_gym.config import vllm_keys
from hanzo_gym.config.vllm_keys import vllm_settings
from hanzo_gym.errors import GymError
from hanzo_gym.model.load_plan import BaseModelPlan, Quantization
from hanzo_gym.records import SamplingParams
from hanzo_gym.rollout.policy_weights import merged_weights
from hanzo_gym.rollout.vllm_requests import sampled_sequence, vllm_sampling_fields

GRPO = """\
base_model: Qwen/Qwen3-0.6B
output_dir: out
adapter: lora
lora_r: 16
lora_target_linear: true
sequence_len: 256
datasets:
  - path: data.jsonl
    type: chat_template
rl: grpo
trl:
  max_completion_length: 64
  reward_funcs: [numeric_match]
"""


_load, _error = load_text, error_of


def test_server_mode_is_axolotls_default_and_reads_the_vllm_block(tmp_path):
    cfg = _load(tmp_path, GRPO + "  use_vllm: true\nvllm:\n  host: 10.0.0.5\n  port: 8123\n")
    settings = vllm_settings(cfg.trl, cfg.vllm)
    assert (settings.mode, settings.base_url, settings.timeout_s, settings.lora_sync) == (
        "server",
        "http://10.0.0.5:8123",
        240.0,
        True,
    )
    cfg = _load(
        tmp_path,
        GRPO + "  use_vllm: true\n  vllm_server_host: 0.0.0.0\n  vllm_server_port: 9000\n"
        "  vllm_server_timeout: 30\nvllm:\n  port: 8123\n",
    )
    settings = vllm_settings(cfg.trl, cfg.vllm)
    assert (settings.base_url, settings.timeout_s) == ("http://127.0.0.1:9000", 30.0)  # trl's keys win


def test_colocate_takes_the_memory_share_and_merges_unless_lora_sync(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_keys, "vllm_installed", lambda: True)
    cfg = _load(tmp_path, GRPO + "  use_vllm: true\n  vllm_mode: colocate\n")
    settings = vllm_settings(cfg.trl, cfg.vllm)
    assert (settings.memory_utilization, settings.lora_sync, settings.enforce_eager) == (0.3, False, True)
    cfg = _load(
        tmp_path,
        GRPO + "  use_vllm: true\n  vllm_mode: colocate\n  vllm_lora_sync: true\n"
        "vllm:\n  gpu_memory_utilization: 0.6\n  dtype: bfloat16\n",
    )
    settings = vllm_settings(cfg.trl, cfg.vllm)
    assert (settings.memory_utilization, settings.lora_sync, settings.dtype) == (0.6, True, "bfloat16")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("  vllm_mode: colocate\n", "set without `trl.use_vllm: true`"),
        ("vllm:\n  port: 8000\n", "`vllm:` set without `trl.use_vllm: true`"),
        ("  use_vllm: true\n  vllm_lora_sync: false\n", "only a colocated vLLM can reload"),
        ("  use_vllm: true\n  vllm_gpu_memory_utilization: 0.5\n", "a server sets its own"),
        (
            "  use_vllm: true\n  vllm_mode: colocate\n  vllm_server_port: 8000\n",
            "`trl.vllm_server_port` name a server",
        ),
        ("  use_vllm: true\n  vllm_mode: remote\n", "vllm_mode"),
        ("  use_vllm: true\n  vllm_enable_sleep_mode: true\n", "`trl.vllm_enable_sleep_mode` (freeing"),
        (
            "  use_vllm: true\n  vllm_importance_sampling_correction: true\n",
            "`trl.vllm_importance_sampling_correction` (TRL's importance-ratio correction",
        ),
        ("  use_vllm: true\nvllm:\n  serve_module: my.module\n", "`vllm.serve_module` (Axolotl's own vLLM"),
    ],
)
def test_vllm_keys_that_would_do_nothing_or_cannot_work_are_refused(tmp_path, monkeypatch, extra, expected):
    monkeypatch.setattr(vllm_keys, "vllm_installed", lambda: True)
    assert expected in _error(tmp_path, GRPO + extra)


def test_vllm_rollouts_need_grpo(tmp_path):
    text = GRPO.replace("rl: grpo\n", "").replace("  reward_funcs: [numeric_match]\n", "")
    assert "needs `rl: grpo`" in _error(tmp_path, text + "  use_vllm: true\n")


def test_colocate_without_vllm_installed_fails_at_load_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_keys, "vllm_installed", lambda: False)
    message = _error(tmp_path, GRPO + "  use_vllm: true\n  vllm_mode: colocate\n")
    assert "pip install 'hanzo-gym[vllm]'" in message and "pip uninstall -y torchvision" in message
    # server mode talks HTTP: it needs no vLLM here
    assert _load(tmp_path, GRPO + "  use_vllm: true\n").trl.use_vllm


def test_gym_vllm_serve_starts_vllm_with_runtime_lora_loading_and_the_vllm_block(tmp_path):
    cfg = _load(
        tmp_path,
        GRPO.replace("lora_r: 16", "lora_r: 20")
        + "  use_vllm: true\nvllm:\n  host: 127.0.0.1\n  port: 8123\n  gpu_memory_utilization: 0.5\n"
        "  enforce_eager: true\n  enable_prefix_caching: false\n",
    )
    command = vllm_serve_command(cfg, tmp_path / "model", "bfloat16")
    assert command[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"]
    flags = " ".join(command[4:])
    assert flags == (
        f"{tmp_path / 'model'} --host 127.0.0.1 --port 8123 --dtype bfloat16 --max-model-len 320 --enable-lora "
        "--max-lora-rank 32 --max-loras 1 --gpu-memory-utilization 0.5 --enforce-eager "
        "--no-enable-prefix-caching"
    )
    too_big = _load(tmp_path, GRPO.replace("lora_r: 16", "lora_r: 600") + "  use_vllm: true\n")
    with pytest.raises(GymError, match="LoRA ranks up to 512"):
        vllm_serve_command(too_big, tmp_path, "float32")


def test_merged_weights_equal_peft_merge_and_unload_without_touching_the_model():
    base = tiny_model("llama", tie_word_embeddings=False)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = dict(merged_weights(model, torch.float32))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing merged in place
    reference = model.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    original = before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert not torch.allclose(
        merged["model.layers.0.self_attn.q_proj.weight"], original
    )  # the adapter counts


def test_merged_weights_come_in_the_engines_dtype_and_tied_weights_once():
    base = tiny_model("llama", tie_word_embeddings=True).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    merged = dict(merged_weights(model, torch.bfloat16))
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in merged and "model.embed_tokens.weight" in merged


def test_requests_stop_where_the_built_in_sampler_stops(smollm2_tokenizer):
    params = SamplingParams(max_tokens=8, seed=3, temperature=0.7, top_k=-1, top_p=0.9, stop=[5, "\n\n"])
    fields = vllm_sampling_fields(params, smollm2_tokenizer)
    assert fields["stop_token_ids"] == [5, smollm2_tokenizer.eos_token_id]
    assert (fields["stop"], fields["ignore_eos"], fields["top_k"], fields["logprobs"]) == (
        ["\n\n"],
        True,
        0,
        0,
    )
    with pytest.raises(GymError, match="max_tokens"):
        vllm_sampling_fields(SamplingParams(), smollm2_tokenizer)
    with pytest.raises(GymError, match="`abort`"):
        sampled_sequence([1], [-0.5], "abort")


def test_a_server_that_never_answers_is_named_with_what_to_do(tmp_path):
    from hanzo_gym.rollout.vllm_server import VllmServerSampler

    settings = vllm_settings(
        vllm_keys.VllmTrlKeys(use_vllm=True, vllm_server_port=9, vllm_server_timeout=1), None
    )
    with pytest.raises(
        GymError, match=r"no vLLM server answered at http://127.0.0.1:9 within 1 s.*gym vllm-serve"
    ):
        VllmServerSampler(engine=None, settings=settings, workdir=tmp_path)


def test_the_tinker_client_asks_for_a_known_sampler_and_names_the_vllm_install(
    tmp_path, tiny_dir, monkeypatch
):
    from hanzo_gym import tinker

    with pytest.raises(GymError, match="sampler must be `builtin` or `vllm`"):
        tinker.ServiceClient(root=tmp_path, sampler="fast", dtype=torch.float32)
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM not installed
    service = tinker.ServiceClient(root=tmp_path, sampler="vllm", dtype=torch.float32)
    with pytest.raises(GymError, match=r"needs vLLM, which is not installed here: on a GPU `pip install"):
        service.create_lora_training_client(tiny_dir, rank=4)


def _quantized_policy(kind: str, quantization: Quantization, directory):
    """A LoRA policy (B not zero) over the tiny model saved in `directory`, loaded 4- or 8-bit, after one forward
    (an 8-bit layer moves its scales at its first)."""
    import warnings

    from hanzo_gym.model.hub import load_causal_lm
    from hanzo_gym.model.lora import attach_lora

    quantized = load_causal_lm(BaseModelPlan.of(str(directory), torch.float32, quantization=quantization))
    experts = ["experts.gate_up_proj", "experts.down_proj"] if kind == "qwen3_moe" else None
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policy = attach_lora(
            quantized,
            r=4,
            alpha=8,
            dropout=0.0,
            target_modules=["q_proj", "v_proj"],
            base_model_name="tiny",
            target_parameters=experts,
        )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
        policy(TOKENS)
    return policy


TOKENS = torch.tensor([list(range(3, 40))])


@pytest.mark.parametrize(
    ("kind", "quantization"),
    [("llama", Quantization(bits=4)), ("qwen3_moe", Quantization(bits=4, moe_experts=True))],
    ids=["nf4", "nf4-experts"],
)
def test_over_a_4bit_base_the_merged_weights_are_the_policy_the_trainer_computes(
    kind, quantization, tmp_path
):
    """What colocated vLLM is handed over QLoRA: a plain model with these weights computes the trainer's logits
    (the dequantized base plus the adapter), not the full-precision checkpoint's."""
    from transformers import AutoModelForCausalLM

    tiny_model(kind, initializer_range=0.2).save_pretrained(tmp_path)
    policy = _quantized_policy(kind, quantization, tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    merged = dict(merged_weights(policy, torch.float32))
    assert merged.keys() == plain.state_dict().keys()
    with torch.no_grad():
        checkpoint_logits = plain(TOKENS).logits
        plain.load_state_dict(merged)
        expected = policy(TOKENS).logits
        torch.testing.assert_close(plain(TOKENS).logits, expected, rtol=1e-5, atol=1e-5)
        assert (checkpoint_logits - expected).abs().max() > 1e-3  # the full-precision base is another model
        plain.load_state_dict(dict(merged_weights(policy, torch.float32, fold_adapter=False)))
        with policy.disable_adapter():
            torch.testing.assert_close(plain(TOKENS).logits, policy(TOKENS).logits, rtol=1e-5, atol=1e-5)


def test_over_an_8bit_base_the_merged_weights_hold_its_int8_rows(tmp_path):
    """LLM.int8() rounds the activations too, which no plain model does; its weights are bitsandbytes' int8 rows
    of the saved ones (quantized from fp16), dequantized."""
    import bitsandbytes.functional as bnb_functional

    saved = tiny_model("llama", initializer_range=0.2)
    saved.save_pretrained(tmp_path)
    policy = _quantized_policy("llama", Quantization(bits=8), tmp_path)
    base = dict(merged_weights(policy, torch.float32, fold_adapter=False))
    merged = dict(merged_weights(policy, torch.float32))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        weight = saved.get_parameter(name).detach().to(torch.float16)
        rows, scales, _ = bnb_functional.int8_vectorwise_quant(weight)
        torch.testing.assert_close(base[name], bnb_functional.int8_vectorwise_dequant(rows, scales).float())
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    layer = policy.get_base_model().model.layers[0].self_attn.q_proj
    torch.testing.assert_close(merged[q_proj], base[q_proj] + layer.get_delta_weight("default"))


def test_server_mode_refuses_a_quantized_base():
    from config_files import refusal_of

    message = refusal_of(adapter="qlora", load_in_4bit=True, rl="grpo", trl={"use_vllm": True})
    assert "the server adds each adapter to the full-precision base" in message
