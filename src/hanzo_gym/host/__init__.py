"""Above the engine, for the front ends that share one base model among many clients: the model host (one base
model, named LoRA adapters, one operation at a time) and the sample batcher (requests that wait together
decode as one batch)."""
