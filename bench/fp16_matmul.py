"""Whether this machine multiplies fp16 natively: GFLOP/s of fp16 against bf16 and fp32 at SmolLM2-135M's MLP
shape (512×576×1536), what an `fp16: true` run computes its matmuls in.

    python bench/fp16_matmul.py [--seconds 2]

A CPU without avx512_fp16 or AMX-FP16 emulates fp16 matmuls; a GPU with tensor cores runs them as fast as bf16.
This script only measures; it judges nothing.
"""

from __future__ import annotations

import argparse
import os

import torch
from matmul_peak import matmul_gflops

SHAPE = (512, 576, 1536)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="time per precision")
    opts = parser.parse_args()
    features = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    native = [flag for flag in ("avx512_fp16", "amx_fp16", "avx512_bf16", "amx_bf16") if features.get(flag)]
    print(
        f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"native: {', '.join(native) or 'none of avx512_fp16, amx_fp16, avx512_bf16, amx_bf16'}, "
        f"1-minute load average at start {os.getloadavg()[0]:.2f}"
    )
    measured = {name: matmul_gflops(*SHAPE, dtype, opts.seconds) for name, dtype in DTYPES.items()}
    for name, gflops in measured.items():
        print(f"{name:>5} {gflops:10.1f} GFLOP/s  {gflops / measured['fp32']:7.3f}x fp32")


if __name__ == "__main__":
    main()
