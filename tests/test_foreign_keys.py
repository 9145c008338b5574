"""The keys Axolotl reads: config/axolotl_schema_keys.py against the installed Axolotl's own schema (the test
extra installs axolotl 0.19 without its dependencies). A config key that is in neither that list nor ours is one
Axolotl ignores, and schema.py leaves it out saying so."""

from __future__ import annotations

import importlib
import pkgutil

from hanzo_gym.config.axolotl_schema_keys import AXOLOTL_KEYS


def _installed_axolotl_keys() -> set[str]:
    import axolotl.integrations
    from axolotl.utils.schemas.config import AxolotlInputConfig

    keys = {field.alias or name for name, field in AxolotlInputConfig.model_fields.items()}
    for module in pkgutil.iter_modules(axolotl.integrations.__path__):
        try:
            args = importlib.import_module(f"axolotl.integrations.{module.name}.args")
        except ImportError:  # a plugin whose own dependencies are not installed
            continue
        for value in vars(args).values():
            if isinstance(value, type) and value.__name__.endswith("Args") and hasattr(value, "model_fields"):
                keys |= {field.alias or name for name, field in value.model_fields.items()}
    return keys


def test_the_list_of_axolotls_keys_is_its_schemas():
    installed = _installed_axolotl_keys()
    assert len(installed) > 400
    assert AXOLOTL_KEYS == installed
    # keys users' configs carry that Axolotl's schema does not declare, and so ignores
    assert not {"wandb_run_name", "torch_dtype", "checkpoint_dir", "expert_offload"} & installed
