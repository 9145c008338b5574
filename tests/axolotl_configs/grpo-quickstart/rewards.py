"""The reward module Axolotl's GRPO quick-start (docs/grpo.qmd) has its user write as `rewards.py` in the working
directory: our own version of its three functions, with the signatures the config names them by (TRL's reward
signature; Axolotl's `type: module.function` dataset transform)."""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def accuracy_reward(completions, answer, **kwargs) -> list[float]:
    """1 where the completion's last number is the reference answer."""
    last = [(NUMBER.findall(c[0]["content"]) or [""])[-1] for c in completions]
    return [float(got == str(want)) for got, want in zip(last, answer)]


def format_reward(completions, **kwargs) -> list[float]:
    """1 where the completion has both a <think> and an <answer> section."""
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    return [float(all(tag in c[0]["content"] for tag in tags)) for c in completions]


def prompt_transform(cfg, *args, **kwargs):
    """GSM8K rows (`question`, `answer` ending `#### N`) as a chat prompt and the number to reward."""

    def transform(example, tokenizer=None):
        return {
            "prompt": [
                {
                    "role": "system",
                    "content": "Think in <think> tags, then give the number in <answer> tags.",
                },
                {"role": "user", "content": example["question"]},
            ],
            "answer": example["answer"].split("####")[-1].strip().replace(",", ""),
        }

    return transform, {"remove_columns": ["question"]}
