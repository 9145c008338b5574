"""How the sampler's output projection is ordered: h·Wᵀ against (W·hᵀ)ᵀ for a few rows of hidden states and a
vocabulary-sized W (SmolLM2's 49152 × 576 by default). It only measures; `sampling._NextTokenLogits` uses the
faster order.

    python bench/output_projection.py [--vocab 49152] [--hidden 576] [--rows 1 8 16 64]
"""

from __future__ import annotations

import argparse
import time

import torch


def milliseconds(fn, repeats: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--repeats", type=int, default=20)
    opts = parser.parse_args()
    weight = torch.randn(opts.vocab, opts.hidden)
    print(f"W {opts.vocab}×{opts.hidden} fp32, {torch.get_num_threads()} threads")
    print(f"{'rows':>5} {'h·Wᵀ ms':>9} {'(W·hᵀ)ᵀ ms':>12} {'ratio':>6}")
    for rows in opts.rows:
        hidden = torch.randn(rows, opts.hidden)
        plain = milliseconds(lambda h=hidden: h @ weight.T, opts.repeats)
        streamed = milliseconds(lambda h=hidden: (weight @ h.T).T, opts.repeats)
        print(f"{rows:5d} {plain:9.1f} {streamed:12.1f} {plain / streamed:5.2f}x")


if __name__ == "__main__":
    main()
