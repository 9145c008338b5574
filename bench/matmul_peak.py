"""The matmul peak of this machine in bf16 and fp32 at SmolLM2-135M's layer shapes: what utilisation is measured
against.

    python bench/matmul_peak.py [--seconds 2] [--threads N]

Shapes are M×K×N for an [M, K] @ [K, N] product, M the tokens of one pass: 512×576×1536 (the MLP's gate and up
projections), 512×576×576 (attention's q and o), 2048×576×49152 (the output projection over 2048 tokens). Each
shape runs for about `--seconds` after one warm-up call; GFLOP/s = 2·M·K·N per call over the mean time of a call.
The peak of a precision is its best shape. This script only measures; it judges nothing.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

SHAPES = ((512, 576, 1536), (512, 576, 576), (2048, 576, 49152))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float) -> float:
    """GFLOP/s of an [m, k] @ [k, n] product in `dtype`, timed for about `seconds` after a warm-up call."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(k, n, generator=generator).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: oneDNN builds its kernel for this shape once
    calls, started = 0, time.perf_counter()
    while True:
        torch.mm(a, b, out=out)
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds and calls >= 3:
            break
    return 2 * m * k * n * calls / elapsed / 1e9


def measure(seconds: float = 2.0) -> dict[str, dict[tuple[int, int, int], float]]:
    """GFLOP/s by precision ("bf16", "fp32") and shape."""
    return {
        name: {shape: matmul_gflops(*shape, dtype, seconds) for shape in SHAPES}
        for name, dtype in DTYPES.items()
    }


def peaks(measured: dict[str, dict[tuple[int, int, int], float]]) -> dict[str, float]:
    """The peak GFLOP/s of each precision: its best shape."""
    return {name: max(by_shape.values()) for name, by_shape in measured.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="time per shape and precision")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(
        f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"1-minute load average at start {os.getloadavg()[0]:.2f}"
    )
    measured = measure(opts.seconds)
    print(f"{'M×K×N':>16} {'bf16 GFLOP/s':>13} {'fp32 GFLOP/s':>13} {'bf16/fp32':>10}")
    for shape in SHAPES:
        bf16, fp32 = measured["bf16"][shape], measured["fp32"][shape]
        print(f"{'×'.join(map(str, shape)):>16} {bf16:13.1f} {fp32:13.1f} {bf16 / fp32:9.2f}x")
    best = peaks(measured)
    print(f"{'peak':>16} {best['bf16']:13.1f} {best['fp32']:13.1f} {best['bf16'] / best['fp32']:9.2f}x")


if __name__ == "__main__":
    main()
