"""How long a short request takes on `gym serve` while a long one runs, against the same request on the idle
server. Prints p50/p95 latency of both and their ratio; it only measures, it never passes or fails.

    python bench/serve_latency.py [--short 8] [--long-n 8] [--long-tokens 384]

To see what the code of another commit did, run this script with that commit's `src` first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import urllib.error
import urllib.request

SHORT_PROMPT = "The three primary colours are"


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise SystemExit(f"{url} answered {error.code}: {error.read().decode(errors='replace')}") from None


def short_request(base: str, model: str, tokens: int) -> float:
    started = time.perf_counter()
    reply = post(
        f"{base}/completions",
        {"model": model, "prompt": SHORT_PROMPT, "max_tokens": tokens, "temperature": 0},
    )
    assert reply["usage"]["completion_tokens"] >= 1, reply
    return time.perf_counter() - started


def decode_step_ms(host, rows: int, context: int = 350, steps: int = 20) -> float:
    """One decode step of `rows` rows after a `context`-token prompt, in ms: what a row costs the rows it
    shares a batch with (the reason a short request does not join a big running batch)."""
    from hanzo_gym.engine.decoding import decoding
    from hanzo_gym.engine.sampling import DecodeBatch, Prompt
    from hanzo_gym.records import SamplingParams

    prompt = (host.tokenizer(SHORT_PROMPT * 100)["input_ids"] * 2)[:context]
    with decoding(host.model):
        batch = DecodeBatch(host.model, host.tokenizer, seed=0)
        batch.add([Prompt(prompt, rows, SamplingParams(max_tokens=steps + 3, temperature=1.0))])
        batch.step()  # the first step follows the prefill
        started = time.perf_counter()
        for _ in range(steps):
            batch.step()
        return (time.perf_counter() - started) / steps * 1000


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", type=int, default=8, help="short requests per phase (default 8)")
    parser.add_argument("--short-tokens", type=int, default=16, help="tokens a short request asks for")
    parser.add_argument("--long-n", type=int, default=8, help="samples of the long request (default 8)")
    parser.add_argument("--long-tokens", type=int, default=384, help="max_tokens of the long request")
    opts = parser.parse_args()

    from hanzo_gym.host.model_host import ModelHost
    from hanzo_gym.model.hub import real_model_gguf
    from hanzo_gym.serve import ServedModels, Server

    host = ModelHost(str(real_model_gguf()))
    models = ServedModels(host, name="smollm2")
    with Server(models, port=0) as server:
        base = server.url  # …/v1
        short_request(base, "smollm2", opts.short_tokens)  # warm-up
        idle = [short_request(base, "smollm2", opts.short_tokens) for _ in range(opts.short)]

        long_result: dict = {}

        def run_long() -> None:
            started = time.perf_counter()
            reply = post(
                f"{base}/chat/completions",
                {
                    "model": "smollm2",
                    "messages": [
                        {"role": "user", "content": "Write a long story about a lighthouse keeper."}
                    ],
                    "n": opts.long_n,
                    "max_tokens": opts.long_tokens,
                    "temperature": 1.0,
                },
            )
            long_result["seconds"] = time.perf_counter() - started
            long_result["tokens"] = reply["usage"]["completion_tokens"]

        long_thread = threading.Thread(target=run_long)
        long_thread.start()
        time.sleep(2.0)  # the long request is decoding by now
        loaded, overlapped = [], 0
        for _ in range(opts.short):
            loaded.append(short_request(base, "smollm2", opts.short_tokens))
            overlapped += long_thread.is_alive()
            time.sleep(0.2)
        long_thread.join()
    models.batcher.close()

    print(f"machine: {os.cpu_count()} cores, 1-minute load average {os.getloadavg()[0]:.2f}")
    print(
        f"long request: n={opts.long_n}, max_tokens={opts.long_tokens}: {long_result['tokens']} tokens in "
        f"{long_result['seconds']:.1f} s; {overlapped} of {opts.short} short requests ended while it ran"
    )
    print(f"short request: {opts.short_tokens} tokens, greedy, /v1/completions")
    for label, values in (("idle server", idle), ("beside the long one", loaded)):
        print(
            f"  {label:20s} p50 {percentile(values, 0.5):7.3f} s   p95 {percentile(values, 0.95):7.3f} s   "
            f"mean {statistics.mean(values):7.3f} s"
        )
    print(
        f"ratio (beside / idle): p50 {percentile(loaded, 0.5) / percentile(idle, 0.5):.2f}x, "
        f"p95 {percentile(loaded, 0.95) / percentile(idle, 0.95):.2f}x (target: p95 under 2x)"
    )
    try:
        costs = {rows: decode_step_ms(host, rows) for rows in (1, 2, 9)}
    except ImportError:
        return  # code from before continuous batching: no DecodeBatch to time
    print(
        "decode step after 350 tokens: "
        + ", ".join(f"{rows} rows {ms:.0f} ms ({ms / costs[1]:.2f}x)" for rows, ms in costs.items())
    )


if __name__ == "__main__":
    main()
