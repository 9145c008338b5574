"""Activations held in host memory between the forward and the backward pass (Axolotl's `activation_offloading`).

Autograd's saved-tensor hooks move each activation the backward pass will need into host memory as it is saved,
and back to its device when the backward pass reads it: the same tensors, so the same gradients, with the
device's memory holding only the pass in flight. Weights are left where they are (they stay resident anyway),
and so are small tensors, whose copies would cost more time than the memory they free.
"""

from __future__ import annotations

import torch

# Below this a copy's latency outweighs the memory it frees.
MIN_OFFLOAD_BYTES = 1 << 16


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Within this context, saved activations of at least `min_bytes` go to host memory (pinned when
    `pin_memory`, so the copies overlap the device's work). `offloaded` counts them."""

    def __init__(self, pin_memory: bool, min_bytes: int = MIN_OFFLOAD_BYTES):
        self.offloaded = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor | tuple[torch.device, torch.Tensor]:
            if isinstance(tensor, torch.nn.Parameter) or tensor.numel() * tensor.element_size() < min_bytes:
                return tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin_memory)
            host.copy_(tensor, non_blocking=pin_memory)
            self.offloaded += 1
            return tensor.device, host

        def unpack(packed: torch.Tensor | tuple[torch.device, torch.Tensor]) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, host = packed
            return host.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)
