"""The training loops over the engine's primitives: SFT and GRPO, their shared tail (logging window, evals,
checkpoints), the learning-rate schedule, the run directory, and `run_training`, which wires config, data,
model and engine together for `gym train` and `gym trainjob`."""
