"""`gym serve`: an OpenAI-compatible server (chat and text completions, models, runtime LoRA loading) over one
base model and its adapters, sampled through the engine's batching sampler."""

from hanzo_gym.serve.models import ServedModels
from hanzo_gym.serve.protocol import APIError
from hanzo_gym.serve.server import Server, run_serve, serve

__all__ = ["APIError", "ServedModels", "Server", "run_serve", "serve"]
