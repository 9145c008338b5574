"""The keys Axolotl reads: config/axolotl_schema_keys.py against the installed Axolotl's own schema (the test
extra installs axolotl 0.19 without its dependencies). A config key that is in neither those lists nor ours is one
Axolotl ignores, and schema.py leaves it out saying so."""

from __future__ import annotations

import importlib
import pkgutil

from config_files import parse_minimal, refusal_of

from hanzo_gym.config import axolotl_schema_keys
from hanzo_gym.config.feature import feature_notes


def _names(*models) -> set[str]:
    return {field.alias or name for model in models for name, field in model.model_fields.items()}


def _installed_axolotl_keys() -> dict[str, set[str]]:
    import axolotl.integrations
    from axolotl.utils.schemas.config import AxolotlInputConfig
    from axolotl.utils.schemas.datasets import DPODataset, KTODataset, SFTDataset, SyntheticDataset
    from axolotl.utils.schemas.trl import TRLConfig

    top = _names(AxolotlInputConfig)
    for module in pkgutil.iter_modules(axolotl.integrations.__path__):
        try:
            args = importlib.import_module(f"axolotl.integrations.{module.name}.args")
        except ImportError:  # a plugin whose own dependencies are not installed
            continue
        plugin_args = [
            value
            for value in vars(args).values()
            if isinstance(value, type) and value.__name__.endswith("Args") and hasattr(value, "model_fields")
        ]
        top |= _names(*plugin_args)
    return {
        "AXOLOTL_KEYS": top,
        "AXOLOTL_DATASET_KEYS": _names(SFTDataset, DPODataset, KTODataset, SyntheticDataset),
        "AXOLOTL_TRL_KEYS": _names(TRLConfig),
    }


def test_the_lists_of_axolotls_keys_are_its_schemas():
    installed = _installed_axolotl_keys()
    assert len(installed["AXOLOTL_KEYS"]) > 400
    for name, keys in installed.items():
        assert getattr(axolotl_schema_keys, name) == keys, name
    # keys users' configs carry that Axolotl's schema does not declare, and so ignores
    assert (
        not {"wandb_run_name", "torch_dtype", "checkpoint_dir", "expert_offload"} & installed["AXOLOTL_KEYS"]
    )


def test_a_dataset_or_trl_key_axolotl_does_not_declare_is_left_out_saying_so():
    cfg = parse_minimal(
        datasets=[{"path": "d.jsonl", "type": "chat_template", "train_split": "train", "val_split": "test"}]
    )
    assert feature_notes(cfg)[:2] == [
        "run.yaml: `datasets[0].train_split` is no key of Axolotl 0.19's, which ignores it, and so does this run",
        "run.yaml: `datasets[0].val_split` is no key of Axolotl 0.19's, which ignores it, and so does this run",
    ]
    grpo = {"rl": "grpo", "trl": {"reward_funcs": ["exact_match"], "vllm_device": "auto"}}
    assert "`trl.vllm_device` is no key of Axolotl 0.19's" in feature_notes(parse_minimal(**grpo))[0]
    # one of Axolotl's that is not read here, and a misspelling of ours, are refused
    sync = {"rl": "grpo", "trl": {"reward_funcs": ["exact_match"], "sync_ref_model": True}}
    assert "Axolotl's `trl.sync_ref_model` is not supported yet; remove it" in refusal_of(**sync)
    message = refusal_of(datasets=[{"path": "d.jsonl", "type": "chat_template", "field_mesages": "m"}])
    assert "`datasets[0].field_mesages`" in message and "`field_messages`" in message
