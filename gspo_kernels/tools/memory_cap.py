"""Memory caps for the benchmark workers: the memory a device has available, a cap a worker process applies to
itself, and whether an error's text says it ran out of memory.

CPU: the cap is the soft ``RLIMIT_DATA`` of the process (its private writable memory: what ``malloc`` and torch's
CPU allocator map) set at its current data size plus the bytes allowed, so an allocation past it fails with
``ENOMEM`` (torch: "DefaultCPUAllocator: can't allocate memory") instead of the kernel's out-of-memory killer
picking a process of the machine. CUDA: ``torch.cuda.set_per_process_memory_fraction`` at the allocation now plus
the bytes allowed (torch raises ``torch.cuda.OutOfMemoryError``).
"""

from __future__ import annotations

import re
from typing import Optional

OOM_PATTERN = re.compile(r"can't allocate memory|cannot allocate memory|out of memory|MemoryError|bad_alloc|"
                         r"OutOfMemoryError", re.IGNORECASE)


def available_bytes(device: str) -> int:
    """Bytes the device can hand out now: CPU ``MemAvailable`` (``/proc/meminfo``), CUDA the free device memory."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info()[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("MemAvailable not found in /proc/meminfo")


def _data_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmData not found in /proc/self/status")


def apply_cap(extra_bytes: int, device: str) -> None:
    """Let this process allocate at most ``extra_bytes`` (int >= 0) more on ``device`` ("cpu" or "cuda[:i]")."""
    if not isinstance(extra_bytes, int) or isinstance(extra_bytes, bool) or extra_bytes < 0:
        raise ValueError(f"extra_bytes must be an int >= 0, got {extra_bytes!r}")
    if device.startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        fraction = min(1.0, (torch.cuda.memory_allocated(torch.device(device)) + extra_bytes) / total)
        torch.cuda.set_per_process_memory_fraction(fraction, torch.device(device))
        return
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _data_bytes() + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))


def is_out_of_memory(reason: Optional[str]) -> bool:
    """Whether an error message (a worker's ``reason``) says an allocation failed for want of memory."""
    return bool(reason) and OOM_PATTERN.search(reason) is not None
