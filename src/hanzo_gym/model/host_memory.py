"""Freed tensor memory goes back to the system on Linux, instead of staying with the C allocator.

glibc serves an allocation above its mmap threshold with a fresh mapping and unmaps it on free; below it, from a
heap that only shrinks from the top. The threshold starts at 128 KB and rises to the size of each large block
freed, up to 32 MB, so after the first few tensors nearly every tensor of a training step comes from the heap,
and a step's freed activations stay resident behind the tensors that outlive it. A DPO run on SmolLM2-135M in
bf16 ended its steps at 1.31 GB this way and peaked at 1.49 GB; with the threshold fixed at 4 MB (and the heap
trimmed once 128 MB are free at its top) it ends them at 1.15 GB and peaks at 1.33 GB, and steps no slower
(0.97 s against 1.06 s: a fresh mapping for a large tensor costs less than reusing a fragmented heap). Smaller
thresholds are slower (every mid-sized tensor faults in new pages); a trim threshold alone changes nothing, as
glibc keeps its rising mmap threshold only while none of its settings is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 128 << 20
_USERS_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def return_large_frees_to_the_system() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module); False where the C library is
    not glibc or the user has set glibc's own MALLOC_* variables, which stay in force."""
    if platform.libc_ver()[0] != "glibc" or any(name in os.environ for name in _USERS_SETTINGS):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
