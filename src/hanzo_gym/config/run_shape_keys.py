"""Cross-key rules of Axolotl's keys that shape where a run starts and how its batches are formed:
`lora_model_dir`, `trust_remote_code`, `pad_to_sequence_len`, `eval_sample_packing`, `group_by_length`,
`curriculum_sampling`, `sample_packing_sequentially` and `strict`. `Config` declares the keys; its cross-key
rules call `check_run_shape_keys`."""

from __future__ import annotations

from pathlib import Path

# DPO, IPO and KTO compare the policy with a reference model. hanzo-gym's reference is the base model (the
# adapter disabled); TRL 1.16, handed a model that already has an adapter, makes a frozen copy of that starting
# adapter the reference instead, and Axolotl hands these methods a fresh adapter (the directory's weights unused).
REFERENCE_METHODS = ("dpo", "ipo", "kto")


def looks_like_local_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or Path(value).expanduser().exists()


def check_run_shape_keys(cfg) -> None:
    """ValueError with the sentence to show."""
    if cfg.lora_model_dir is not None:
        _check_lora_model_dir(cfg)
    if cfg.pad_to_sequence_len and cfg.rl is not None:
        raise ValueError(
            f"pad_to_sequence_len pads SFT batches; rl: {cfg.rl} forms its own batches (pairs or rollouts): "
            "remove it"
        )
    if cfg.eval_sample_packing and not cfg.sample_packing:
        raise ValueError(
            "eval_sample_packing: true packs the eval set only together with sample_packing: true (Axolotl's "
            "rule); set sample_packing: true or remove eval_sample_packing"
        )
    if cfg.sample_packing_sequentially and not cfg.sample_packing:
        raise ValueError(
            "sample_packing_sequentially packs samples in order; without sample_packing: true nothing is packed: "
            "set it or remove sample_packing_sequentially"
        )
    if cfg.curriculum_sampling:
        if cfg.rl is not None:
            raise ValueError(
                f"curriculum_sampling orders SFT examples (Axolotl's SFT sampler); rl: {cfg.rl} does not use it: "
                "remove it"
            )
        if cfg.group_by_length:
            raise ValueError(
                "curriculum_sampling keeps the data's order and group_by_length reorders it by length; give one"
            )
    if cfg.group_by_length:
        if cfg.rl is not None:
            raise ValueError(f"group_by_length orders SFT examples; rl: {cfg.rl} does not use it: remove it")
        if cfg.sample_packing:
            raise ValueError(
                "group_by_length and sample_packing: the packer forms the rows, so there is nothing to group "
                "by length (Axolotl's multipack sampler replaces the length-grouped one); give one of them"
            )


def _check_lora_model_dir(cfg) -> None:
    value = cfg.lora_model_dir
    if looks_like_local_path(value):
        path = Path(value).expanduser()
        if not path.is_dir():
            raise ValueError(f"lora_model_dir: {value} is not a directory (a PEFT adapter directory)")
        if not (path / "adapter_config.json").is_file():
            raise ValueError(
                f"lora_model_dir: {value} has no adapter_config.json; point it at a PEFT adapter directory "
                "(a run's output_dir or one of its checkpoint-N folders)"
            )
    if cfg.rl in REFERENCE_METHODS:
        raise ValueError(
            f"lora_model_dir with rl: {cfg.rl} is not supported yet: the reference model would be the base "
            "model here, but a copy of the starting adapter in TRL (and Axolotl does not load the directory "
            "for this method at all); train from a fresh adapter, or use rl: orpo / simpo (no reference)"
        )
    if cfg.rl == "grpo" and cfg.trl.beta > 0:
        raise ValueError(
            "lora_model_dir with rl: grpo and trl.beta > 0 is not supported yet: the KL reference would be the "
            "base model here, but a copy of the starting adapter in TRL; set trl.beta: 0 or start fresh"
        )
