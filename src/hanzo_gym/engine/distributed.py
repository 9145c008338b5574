"""Data-parallel training over torch.distributed, in one place.

Every process holds the whole model and the whole (tokenised) dataset; each takes its shard of every global
batch. Losses are token-level sums whose weights already divide by the global token count, so summing the
gradients over processes (not averaging them, as DDP does) gives exactly the one-process gradient of the
same global batch. The sum happens once per optimizer step, before clipping, so ranks may run different
numbers of forward/backward passes in a step (the last window of an epoch) without waiting on each other.

With one process (no torchrun, WORLD_SIZE unset or 1) every function here is a no-op.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from hanzo_gym.errors import GymError
from hanzo_gym.launch import launched_world_size

T = TypeVar("T")

_ENV_INTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def init_from_env(timeout_s: float = 3600) -> bool:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
    its collectives failing after `timeout_s` seconds of waiting (HF's `ddp_timeout`).

    nccl on CUDA (one GPU per process, chosen by LOCAL_RANK), gloo on CPU. Returns whether training is
    distributed. Idempotent: a second call changes nothing.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if launched_world_size() == 1:
        return False
    missing = [name for name in (*_ENV_INTS, "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise GymError(
            f"WORLD_SIZE is {os.environ['WORLD_SIZE']} but {', '.join(missing)} unset: start the processes "
            "with torchrun (e.g. `torchrun --nproc-per-node 2 --no-python gym trainjob`)"
        )
    if not dist.is_available():
        raise GymError("this torch build has no torch.distributed: run one process (no torchrun)")
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        if local_rank >= torch.cuda.device_count():
            raise GymError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible: start at "
                "most one process per GPU (torchrun --nproc-per-node gpu, or auto)"
            )
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0: the one process that writes the run directory, adapters and logs."""
    return rank() == 0


def say(*lines: str | None) -> None:
    """Print each line that is not empty, on the main process only: rank 0 speaks for all."""
    if is_main():
        for line in lines:
            if line:
                print(line, flush=True)


def shard(items: Sequence[T]) -> list[T]:
    """This rank's share of `items`: every world_size-th item starting at its rank (all when alone)."""
    return list(items[rank() :: world_size()])


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_across(*values: float) -> list[float]:
    """Each value summed over all ranks (float64, one collective for all of them)."""
    if world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def gather_objects(value: Any) -> list[Any]:
    """`value` from every rank, in rank order (picklable objects; for metrics, not tensors of weights)."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_object(value: T) -> T:
    """Rank 0's `value` on every rank."""
    if world_size() == 1:
        return value
    box = [value if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_parameters(params: Iterable[torch.Tensor]) -> None:
    """Rank 0's values of `params` on every rank (DDP does this when it wraps a model)."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for param in params:
            dist.broadcast(param.data, src=0)


def sync_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum the gradients of `params` over all ranks, in one fp32 all-reduce.

    A rank that accumulated nothing this step (its share of the window was empty) contributes zeros. When no
    rank accumulated anything the gradients stay None, so the optimizer step is skipped everywhere alike.
    """
    if world_size() == 1:
        return
    sizes = [p.numel() for p in params]
    flat = torch.zeros(sum(sizes) + 1, dtype=torch.float32, device=_device())
    offset = 0
    for param, size in zip(params, sizes):
        if param.grad is not None:
            flat[offset : offset + size].copy_(param.grad.reshape(-1))
        offset += size
    flat[-1] = float(any(p.grad is not None for p in params))  # how many ranks have gradients
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    if flat[-1].item() == 0:
        return
    offset = 0
    for param, size in zip(params, sizes):
        summed = flat[offset : offset + size].view_as(param).to(param.dtype)
        if param.grad is None:
            param.grad = summed.clone()
        else:
            param.grad.copy_(summed)
        offset += size
