"""The run config: the schema of `gym train`'s YAML (`schema`: the keys every run has, and the features, each a
group of Axolotl keys with its rules in a module of its own, see `feature`) and the YAML reader that keeps line
numbers (`yaml_source`). Loading and validating a config imports neither torch nor transformers."""

from hanzo_gym.config.schema import Config, DatasetConfig, load_config, parse_config

__all__ = ["Config", "DatasetConfig", "load_config", "parse_config"]
