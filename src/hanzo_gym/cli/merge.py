"""`gym merge`: fold a run's adapter into the base weights and write a plain transformers model."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from hanzo_gym.config import Config
from hanzo_gym.errors import GymError
from hanzo_gym.files import publish_directory
from hanzo_gym.loops.train import load_run_tokenizer
from hanzo_gym.model.hub import load_causal_lm, model_source
from hanzo_gym.model.llama4_experts import delinearized
from hanzo_gym.model.load_plan import BaseModelPlan
from hanzo_gym.model.loader_keys import fit_embeddings
from hanzo_gym.model.lora import merged_model, open_adapter


def adapter_directory(cfg: Config, checkpoint: str | None) -> Path:
    directory = Path(cfg.output_dir) / checkpoint if checkpoint else Path(cfg.output_dir)
    if cfg.full_fine_tuning:
        raise GymError(
            f"{cfg.output_dir}: a full fine-tuning run (no `adapter`) has nothing to merge; its output_dir (or a "
            "checkpoint-N in it) is the trained model, which from_pretrained loads as it is"
        )
    if not (directory / "adapter_config.json").is_file():
        hint = "run `gym train` first" if checkpoint is None else "name one of the checkpoint-N folders"
        raise GymError(f"{directory} holds no adapter (no adapter_config.json): {hint}")
    return directory


def merged_from(cfg: Config, adapter_dir: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base model with the adapter in `adapter_dir` folded in, and the run's tokenizer."""
    # Keep the base checkpoint's own dtype so a bf16 model stays bf16 on disk.
    source = model_source(cfg.base_model, cfg.trust_remote_code, cfg.revision_of_model)
    dtype = getattr(
        AutoConfig.from_pretrained(source.directory, trust_remote_code=cfg.trust_remote_code), "dtype", None
    )
    plan = BaseModelPlan(
        source,
        dtype if isinstance(dtype, torch.dtype) else torch.float32,
        linearized_llama4_experts=cfg.llama4_linearized_experts,
    )
    base = load_causal_lm(plan)
    tokenizer = load_run_tokenizer(cfg, source)
    if cfg.tokens or cfg.resize_token_embeddings_to_32x:
        fit_embeddings(base, len(tokenizer), cfg)  # the rows the trained embeddings (modules_to_save) have
    model = merged_model(open_adapter(base, adapter_dir, trainable=False))
    delinearized(model)  # Llama 4's experts written stacked, as every loader of the model reads them
    return model, tokenizer


def merge_run(cfg: Config, out: str | None = None, checkpoint: str | None = None) -> Path:
    adapter_dir = adapter_directory(cfg, checkpoint)
    destination = Path(out) if out else Path(cfg.output_dir) / "merged"
    model, tokenizer = merged_from(cfg, adapter_dir)

    def write(directory: Path) -> None:
        model.save_pretrained(str(directory))
        tokenizer.save_pretrained(str(directory))

    publish_directory(write, destination)
    return destination
