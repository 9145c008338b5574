"""hanzo-gym: LoRA SFT and RL post-training for open causal LMs."""

import logging

__version__ = "0.1.0"

# bitsandbytes warns at import, on CPUs with AVX512-BF16, that an optional kernel for its CPU inference packing is
# missing; hanzo-gym keeps 4-bit weights off that packing (its kernel has no backward), so the line means nothing.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
