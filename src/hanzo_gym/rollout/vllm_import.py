"""Importing vLLM for a colocated engine, with the two things that otherwise go wrong said plainly."""

from __future__ import annotations

import os
from types import ModuleType

import torch

from hanzo_gym.config.vllm_keys import INSTALL_VLLM
from hanzo_gym.errors import GymError


def import_vllm(needed_by: str = "`trl.use_vllm`") -> ModuleType:
    # The engine core in this process: vLLM's default starts it in a spawned process, which re-imports the
    # caller's main module, and colocation means sharing this process's device anyway.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM drops torch to one thread "for serving" unless OMP_NUM_THREADS is set; here that would be the
    # trainer's threads too.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    try:
        import vllm
    except ModuleNotFoundError:
        raise GymError(f"{needed_by} needs vLLM, which is not installed here: {INSTALL_VLLM}") from None
    except RuntimeError as exc:
        if "torchvision" in str(exc) or "torchcodec" in str(exc) or "torchaudio" in str(exc):
            raise GymError(
                "vLLM failed to import because the torchvision / torchcodec / torchaudio it pulled in are "
                "CUDA builds that do not load against this torch; a text model needs none of them: "
                "`pip uninstall -y torchvision torchcodec torchaudio`"
            ) from None
        raise
    return vllm
