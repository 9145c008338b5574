"""A corpus config made runnable offline: its base model, dataset paths and output folder pointed at local ones,
each dataset file holding a few rows in the format its type reads. Nothing else of the config changes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hanzo_gym.config import DatasetConfig
from hanzo_gym.config.dataset_keys import DatasetTypeMapping
from hanzo_gym.renderers.instruction_formats import Composed

# the questions and answers every dataset's rows are made of
QUESTIONS = [(f"What is {a} plus 2?", f"{a + 2}.", f"{a * 5 + 1}, surely.") for a in range(8)]
DATASET_LISTS = ("datasets", "test_datasets")


def local_copy(data: dict, tmp_path: Path, base_model: str) -> dict:
    """`data` with its model, data and output paths local (the dataset files are not written yet)."""
    data["base_model"] = base_model
    for key in ("base_model_config", "tokenizer_config"):
        if data.get(key):
            data[key] = base_model
    data["output_dir"] = str(tmp_path / "run")
    if data.get("dataset_prepared_path"):  # relative to the working directory, as in Axolotl
        data["dataset_prepared_path"] = str(tmp_path / "prepared")
    if data.get("do_bench_eval"):  # Axolotl's default bench_dataset is a hub file
        data["bench_dataset"] = str(tmp_path / "bench.jsonl")
        rows = [
            {"input": f"{q}\nA. yes\nB. no\nAnswer:", "output": "AB"[i % 2], "subject": "dharma: s"}
            for i, (q, _, _) in enumerate(QUESTIONS)
        ]
        (tmp_path / "bench.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if isinstance(data.get("pretraining_dataset"), str):
        data["pretraining_dataset"] = str(tmp_path / "pretraining_dataset-0.jsonl")
    for listed in (
        *DATASET_LISTS,
        "pretraining_dataset",
    ):  # the run trains on a pretraining_dataset as `datasets`
        for number, ds in enumerate(data.get(listed) or []):
            if not isinstance(ds, dict):
                continue
            suffix = ".parquet" if ds.get("ds_type") == "parquet" else ".jsonl"
            ds["path"] = str(tmp_path / f"{listed}-{number}{suffix}")
            for key in ("split", "name", "data_files", "train_on_split"):
                ds.pop(key, None)  # a hub dataset's split, configuration and files, as part of its address
    return data


def write_rows(ds: DatasetConfig, rl: str | None) -> None:
    """A few rows in the format `ds` reads (as parsed: older types already converted), at its path."""
    rows = [_row(ds, rl, question, good, bad, index) for index, (question, good, bad) in enumerate(QUESTIONS)]
    path = Path(ds.path)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _turns(ds: DatasetConfig, question: str, answer: str) -> list[dict[str, str]]:
    names = {role: (ds.roles or {}).get(role, [role])[0] for role in ("user", "assistant")}
    mapping = ds.mappings
    return [
        {mapping.role: names["user"], mapping.content: question},
        {mapping.role: names["assistant"], mapping.content: answer},
    ]


def _row(ds: DatasetConfig, rl: str | None, question: str, good: str, bad: str, index: int) -> dict[str, Any]:
    kind = ds.type
    if kind is None:  # tokenized rows
        ids = [10 + index, 20, 30, 40, 50 + index]
        return {"input_ids": ids, "labels": [-100, -100, *ids[2:]], "attention_mask": [1] * len(ids)}
    if isinstance(kind, DatasetTypeMapping):
        if rl in ("dpo", "ipo", "simpo", "orpo"):
            return {
                kind.field_prompt or "prompt": question,
                kind.field_chosen or "chosen": good,
                kind.field_rejected or "rejected": bad,
            }
        return {kind.field_instruction or "instruction": question, kind.field_output or "output": good}
    if kind == "chat_template":
        return {ds.field_messages: _turns(ds, question, good)}
    if kind in ("completion", "pretrain"):
        return {ds.field: f"{question} {good}"}
    if kind == "input_output":
        return {"segments": [{"text": f"{question} ", "label": False}, {"text": good, "label": True}]}
    if kind == "chat_template.default":
        return {
            ds.field_messages: [{"role": "user", "content": question}],
            ds.field_chosen: {"role": "assistant", "content": good},
            ds.field_rejected: {"role": "assistant", "content": bad},
        }
    if kind in ("chat_template.argilla", "chat_template.argilla_chat"):
        return {
            "chosen": [{"role": "user", "content": question}, {"role": "assistant", "content": good}],
            "rejected": [{"role": "user", "content": question}, {"role": "assistant", "content": bad}],
        }
    if kind.endswith(".intel"):
        return {"system": "", "question": question, "chosen": good, "rejected": bad}
    if kind.endswith(".argilla"):
        return {"instruction": question, "chosen_response": good, "rejected_response": bad}
    if kind.endswith((".ultra", ".prompt_pairs", ".icr")) or kind == "passthrough":
        if rl == "kto":
            return {"prompt": question, "completion": good if index % 2 else bad, "label": bool(index % 2)}
        return {"prompt": question, "chosen": good, "rejected": bad}
    instruction, _, output = (
        ds.instruction_fields
    )  # alpaca and its styles; Axolotl's strategies' composed parts
    return {
        name: text
        for spec, text in ((instruction, question), (output, good))
        for name in (spec.fields if isinstance(spec, Composed) else (spec,))
    }
