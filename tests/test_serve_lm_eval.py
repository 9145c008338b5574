"""EleutherAI's lm-evaluation-harness against `gym serve`: the same tasks through its `local-completions`
model (HTTP, `echo` + `logprobs` for log-likelihoods) and through its `hf` model (transformers in process) on
the same weights must give the same per-answer log-likelihoods, accuracies and greedy generations.

The tasks are small local ones written to a temporary folder (a jsonl dataset and a task YAML each); nothing
is downloaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from hanzo_gym.host.model_host import ModelHost
from hanzo_gym.serve import ServedModels, Server

LOGLIKELIHOOD_TOLERANCE = 1e-3
QUESTIONS = [
    ("Question: What is the capital of France?\nAnswer:", [" Paris", " London", " Berlin", " Madrid"], 0),
    ("Question: How many legs does a spider have?\nAnswer:", [" six", " eight", " four"], 1),
    ("Question: What colour is the sky on a clear day?\nAnswer:", [" green", " red", " blue"], 2),
    ("Question: Which animal says moo?\nAnswer:", [" a cow", " a cat", " a dog"], 0),
    ("Question: What is the opposite of hot?\nAnswer:", [" warm", " cold"], 1),
    ("Question: What do bees make?\nAnswer:", [" milk", " honey", " silk"], 1),
    # Answers the model would write itself: lm-eval's greedy flag is then true, read from top_logprobs.
    ("The capital of France is", [" Paris", " Rome"], 0),
    ("One, two, three, four,", [" six", " five"], 1),
]


@pytest.fixture
def offline(monkeypatch):
    """No hub look-ups: the environment for anything imported later, the flags for what is loaded already."""
    import datasets
    import huggingface_hub

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def write_tasks(directory: Path) -> object:
    """A multiple-choice task (log-likelihoods) and a generation task over the same questions."""
    from lm_eval.tasks import TaskManager

    data = directory / "questions.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS)
    )
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'doc_to_text: "{{question}}"\n'
    )
    (directory / "gym_choice.yaml").write_text(
        "task: gym_choice\n" + common + "output_type: multiple_choice\n"
        'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (directory / "gym_generate.yaml").write_text(
        "task: gym_generate\n" + common + "output_type: generate_until\n"
        'doc_to_target: "{{choices[answer]}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    # Without lm-eval's own thousands of tasks: indexing them takes seconds.
    return TaskManager(include_path=str(directory), include_defaults=False)


def evaluate(model: str, model_args: dict, tasks: list[str], task_manager) -> dict:
    import lm_eval  # here, not at the top: importing it takes seconds, collecting the suite should not

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=task_manager,
        log_samples=True,
        bootstrap_iters=0,
    )


def served_args(server: Server, model: str, tokenizer: str, batch_size: int = 1) -> dict:
    return {
        "model": model,
        "base_url": f"{server.url}/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": tokenizer,
        "batch_size": batch_size,  # > 1: several token-id prompts in one request
        "max_retries": 1,  # a failure is a failure, not a retry
    }


def hf_args(model_dir: str, adapter: str | None = None) -> dict:
    args = {"pretrained": model_dir, "device": "cpu", "dtype": "float32", "batch_size": 1}
    return {**args, "peft": adapter} if adapter else args


def loglikelihoods(results: dict, task: str) -> dict[int, list[float]]:
    return {s["doc_id"]: [resp[0][0] for resp in s["resps"]] for s in results["samples"][task]}


def greedy_flags(results: dict, task: str) -> dict[int, list[bool]]:
    """Per answer, whether every answer token was the model's top choice (lm-eval reads it from top_logprobs)."""
    return {s["doc_id"]: [resp[0][1] for resp in s["resps"]] for s in results["samples"][task]}


def assert_same_choices(served: dict, reference: dict) -> float:
    """Per answer, the same log-likelihood within the tolerance and the same greedy flag; per question, the
    same pick. Returns the largest log-likelihood difference."""
    got, wanted = loglikelihoods(served, "gym_choice"), loglikelihoods(reference, "gym_choice")
    assert got.keys() == wanted.keys() == set(range(len(QUESTIONS)))
    worst = 0.0
    for doc, values in wanted.items():
        assert len(got[doc]) == len(values), doc
        assert all(math.isfinite(v) for v in got[doc])
        worst = max(worst, *(abs(a - b) for a, b in zip(got[doc], values)))
        assert got[doc] == pytest.approx(values, abs=LOGLIKELIHOOD_TOLERANCE), doc
    assert greedy_flags(served, "gym_choice") == greedy_flags(reference, "gym_choice")
    served_picks = {s["doc_id"]: s["acc"] for s in served["samples"]["gym_choice"]}
    assert served_picks == {s["doc_id"]: s["acc"] for s in reference["samples"]["gym_choice"]}
    assert served["results"]["gym_choice"]["acc,none"] == reference["results"]["gym_choice"]["acc,none"]
    return worst


def generations(results: dict) -> dict[int, str]:
    return {s["doc_id"]: s["filtered_resps"][0] for s in results["samples"]["gym_generate"]}


# -- a tiny model: fast enough for every run ---------------------------------------------------------------


def test_lm_eval_local_completions_matches_hf_on_a_tiny_model(tmp_path, offline, wide_qwen3_dir):
    tasks = write_tasks(tmp_path)
    with Server(ServedModels(ModelHost(wide_qwen3_dir, dtype=torch.float32), name="tiny"), port=0) as server:
        served = evaluate(
            "local-completions", served_args(server, "tiny", wide_qwen3_dir, 2), ["gym_choice"], tasks
        )
    worst = assert_same_choices(served, evaluate("hf", hf_args(wide_qwen3_dir), ["gym_choice"], tasks))
    print(f"\nlargest log-likelihood difference, tiny model: {worst:.2e}")


# -- the real SmolLM2-135M-Instruct, and an adapter on it --------------------------------------------------
def random_adapter(model_dir: str, directory: Path) -> str:
    """A LoRA adapter with random A and B (peft's default B = 0 would leave the model as it is)."""
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(directory)
    return str(directory)


@pytest.mark.real_model
def test_lm_eval_local_completions_matches_hf_on_the_real_model_and_an_adapter(tmp_path, offline, real):
    model_dir = str(real.model_dir)
    adapter = random_adapter(model_dir, tmp_path / "adapter")
    tasks = write_tasks(tmp_path)
    both = ["gym_choice", "gym_generate"]
    models = ServedModels(ModelHost(model_dir, dtype=torch.float32), {"tuned": adapter}, name="smollm2")
    with Server(models, port=0) as server:
        served = evaluate("local-completions", served_args(server, "smollm2", model_dir, 4), both, tasks)
        served_tuned = evaluate(
            "local-completions", served_args(server, "tuned", model_dir), ["gym_choice"], tasks
        )
    reference = evaluate("hf", hf_args(model_dir), both, tasks)
    worst = assert_same_choices(served, reference)
    reference_tuned = evaluate("hf", hf_args(model_dir, adapter), ["gym_choice"], tasks)
    worst = max(worst, assert_same_choices(served_tuned, reference_tuned))
    print(f"\nlargest log-likelihood difference, SmolLM2-135M and an adapter on it: {worst:.2e}")
    assert any(flag for flags in greedy_flags(served, "gym_choice").values() for flag in flags)
    assert served["results"]["gym_choice"]["acc,none"] >= 0.5  # a real model, really scored
    assert generations(served) == generations(reference)
    assert any(text.strip() for text in generations(served).values())
    assert (
        served["results"]["gym_generate"]["exact_match,none"]
        == reference["results"]["gym_generate"]["exact_match,none"]
    )
    # The adapter was applied: its scores are not the base model's.
    base_values, tuned_values = (
        loglikelihoods(served, "gym_choice"),
        loglikelihoods(served_tuned, "gym_choice"),
    )
    assert max(abs(a - b) for doc in base_values for a, b in zip(base_values[doc], tuned_values[doc])) > 1e-2
