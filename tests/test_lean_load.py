"""An fp32 checkpoint loads as bf16 tensor by tensor (pread) instead of holding the mapped file: the same
weights, bit for bit, with a lower load peak."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from hanzo_gym.model import hub, lean_load
from hanzo_gym.model.load_plan import BaseModelPlan
from tests.tiny_models import tiny_model

PEAK_PROBE = textwrap.dedent(
    """
    import contextlib, sys, torch
    from hanzo_gym.model import hub
    model_dir, mode = sys.argv[1], sys.argv[2]
    plan = hub.BaseModelPlan.of(model_dir, torch.bfloat16)
    if mode == "mmap":
        hub.reading_tensors_by_pread = lambda *args: contextlib.nullcontext()
    def status(key):
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets the peak resident set (VmHWM) to the current one
    before = status("VmHWM")
    hub.load_causal_lm(plan)
    print(status("VmHWM") - before)
    """
)


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fp32")
    tiny_model("llama").save_pretrained(directory)
    return directory


def test_converts_on_load_reads_the_stored_dtypes(fp32_dir, tmp_path):
    assert lean_load.stored_float_dtypes(fp32_dir / "model.safetensors") == {"F32"}
    assert lean_load.converts_on_load(fp32_dir, torch.bfloat16)
    assert not lean_load.converts_on_load(fp32_dir, torch.float32)
    save_file(
        {"w": torch.zeros(2, dtype=torch.bfloat16), "ids": torch.zeros(2, dtype=torch.long)},
        tmp_path / "a.safetensors",
    )
    assert lean_load.stored_float_dtypes(tmp_path / "a.safetensors") == {"BF16"}
    assert not lean_load.converts_on_load(tmp_path, torch.bfloat16)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "model.safetensors").write_bytes(
        b"\x01"
    )  # cut short: from_pretrained reports it, not this check
    assert not lean_load.converts_on_load(damaged, torch.bfloat16)


def test_pread_load_gives_the_mapped_loads_weights_bit_for_bit(fp32_dir):
    ours = hub.load_causal_lm(BaseModelPlan.of(str(fp32_dir), torch.bfloat16)).state_dict()
    mapped = AutoModelForCausalLM.from_pretrained(fp32_dir, dtype=torch.bfloat16).state_dict()
    assert ours.keys() == mapped.keys()
    for name, tensor in mapped.items():
        assert ours[name].dtype == torch.bfloat16
        assert torch.equal(ours[name], tensor), name


def test_the_patch_is_scoped_to_the_load(fp32_dir):
    original = lean_load.modeling_utils.safe_open
    with lean_load.reading_tensors_by_pread(fp32_dir, torch.bfloat16):
        assert lean_load.modeling_utils.safe_open is not original
    assert lean_load.modeling_utils.safe_open is original
    with lean_load.reading_tensors_by_pread(fp32_dir, torch.float32):  # same dtype: the zero-copy mapped read
        assert lean_load.modeling_utils.safe_open is original


def test_pread_load_peaks_lower_than_the_mapped_load(tmp_path):
    config = LlamaConfig(
        vocab_size=16384, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    file_kb = (tmp_path / "model.safetensors").stat().st_size // 1024  # 134 MB of fp32

    def peak_growth_kb(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", PEAK_PROBE, str(tmp_path), mode],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(run.stdout.split()[-1])

    mapped, pread = peak_growth_kb("mmap"), peak_growth_kb("pread")
    assert mapped > file_kb  # the whole mapped fp32 file was resident beside the bf16 model
    assert pread < mapped - 0.3 * file_kb  # measured: 139 MB against 204 MB
