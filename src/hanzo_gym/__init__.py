"""hanzo-gym: LoRA SFT and RL post-training for open causal LMs."""

__version__ = "0.1.0"
