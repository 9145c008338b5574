"""Memory a training step frees goes back to the system: glibc's thresholds fixed (model/host_memory.py), and
the output layer's chunks sized to the vocabulary (engine/token_logprobs.py). Each probe runs in a process of
its own, since both are about a process's resident set."""

import subprocess
import sys
import textwrap

from hanzo_gym.engine.token_logprobs import chunk_rows
from hanzo_gym.model import host_memory


def _run(probe: str, *args: str, env: dict | None = None) -> float:
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(probe), *args],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return float(run.stdout.split()[-1])


FRAGMENTATION_PROBE = """
    import sys, torch
    from hanzo_gym.model.host_memory import return_large_frees_to_the_system
    if sys.argv[1] == "fixed":
        assert return_large_frees_to_the_system()
    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
    first = torch.ones(5 << 20)  # 20 MB, mapped; freeing it raises glibc's own threshold to 20 MB
    del first
    before = rss_mb()
    blocks = [torch.ones(10 << 18) for _ in range(10)]  # 10 x 10 MB: from the heap at glibc's threshold
    kept = torch.ones(1 << 18)  # a later 1 MB tensor above them, as a step's outputs outlive its activations
    del blocks
    print(rss_mb() - before)
"""


def test_freed_tensors_leave_the_resident_set_with_fixed_thresholds():
    assert _run(FRAGMENTATION_PROBE, "glibc") >= 90  # the 100 MB freed stay resident behind the small tensor
    assert _run(FRAGMENTATION_PROBE, "fixed") < 10


def test_glibc_settings_of_the_user_stay_in_force(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert not host_memory.return_large_frees_to_the_system()


OUTPUT_LAYER_PROBE = """
    import sys, torch
    from hanzo_gym.engine.token_logprobs import token_logprobs
    from hanzo_gym.model.host_memory import return_large_frees_to_the_system
    return_large_frees_to_the_system()
    chunk = int(sys.argv[1]) or None
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(192, 576, generator=generator).bfloat16().requires_grad_()
    weight = (torch.randn(49152, 576, generator=generator) / 20).bfloat16()  # SmolLM2's output layer
    targets = torch.randint(0, 49152, (192,), generator=generator)
    token_logprobs(hidden[:8], weight, targets[:8], chunk)  # warm-up
    def status(key):
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets the peak resident set (VmHWM) to the current one
    before = status("VmHWM")
    logprobs, _ = token_logprobs(hidden, weight, targets, chunk)
    logprobs.sum().backward()
    print((status("VmHWM") - before) / 1024)
"""


def test_the_output_layer_works_in_vocabulary_sized_chunks():
    assert chunk_rows(49152) == 85 and chunk_rows(151936) == 64 and chunk_rows(1000) == 1024
    # 192 positions of SmolLM2: measured 56 MB in chunks of 85 (a chunk's fp32 logits, their exponentials and
    # the bf16 matmul's output: 42 MB), 72 MB in one chunk of 192, 109 MB when each operation had its own buffer
    sized, whole = _run(OUTPUT_LAYER_PROBE, "0"), _run(OUTPUT_LAYER_PROBE, "1024")
    assert sized < 64
    assert sized < whole - 8
