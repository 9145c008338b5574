"""The benchmark part of an SFT evaluation (`do_bench_eval`; questions from data/bench.py), as Axolotl's bench
callback scores it at each evaluation.

Questions go in micro-batches of the eval batch size, in the file's order. The model's answer to a question is the
letter whose token it finds likeliest next after the question; its loss is the next-token NLL of the answer's tokens
(the letter and EOS). Logged as `eval/bench_accuracy_<name>` per group, `eval/bench_average_accuracy` (their mean),
`eval/bench_total_accuracy` (over all questions) and `eval/bench_loss`: each micro-batch's mean NLL per answer token,
averaged over micro-batches, as Axolotl averages the losses of its prediction steps. Under torchrun each process
scores its share of the micro-batches and the results are gathered, so N processes give one process's numbers.
"""

from __future__ import annotations

from hanzo_gym.data.batching import supervised_datum
from hanzo_gym.data.bench import BenchQuestion, letter_tokens
from hanzo_gym.data.example import Example
from hanzo_gym.engine import Engine
from hanzo_gym.engine.distributed import gather_objects, shard
from hanzo_gym.records import IGNORE_INDEX


def _datum(question: BenchQuestion):
    labels = [IGNORE_INDEX] * question.answer_at + question.tokens[question.answer_at :]
    return supervised_datum(Example(question.tokens, labels), 1.0)


def bench_scores(engine: Engine, questions: list[BenchQuestion], batch_size: int) -> dict[str, float]:
    letters = letter_tokens(engine.tokenizer)
    batches = [questions[i : i + batch_size] for i in range(0, len(questions), batch_size)]
    mine = []  # (group, answer, reference) per question and the micro-batch's mean loss, per micro-batch
    for batch in shard(batches):
        at = [q.answer_at - 1 for q in batch]  # the datum position that predicts the answer's first token
        logprobs, choices_DC = engine.forward_choices([_datum(q) for q in batch], letters, at)
        nll = -sum(float(lp[a:].sum()) for lp, a in zip(logprobs, at))
        answer_tokens = sum(len(q.tokens) - q.answer_at for q in batch)
        answers = choices_DC.argmax(-1).tolist()
        mine.append(([(q.name, a, q.reference) for q, a in zip(batch, answers)], nll / answer_tokens))
    scored = [batch for part in gather_objects(mine) for batch in part]
    groups: dict[str, list[bool]] = {}
    for answered, _ in scored:
        for name, answer, reference in answered:
            groups.setdefault(name, []).append(answer == reference)
    scores = {f"eval/bench_accuracy_{name}": sum(hits) / len(hits) for name, hits in groups.items()}
    every = [hit for hits in groups.values() for hit in hits]
    return {
        "eval/bench_loss": sum(loss for _, loss in scored) / len(scored),
        **scores,
        "eval/bench_average_accuracy": sum(scores.values()) / len(scores),
        "eval/bench_total_accuracy": sum(every) / len(every),
    }
