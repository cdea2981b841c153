"""GPU ids as CUDA_VISIBLE_DEVICES names them (indices, or GPU-/MIG- UUIDs)."""

from __future__ import annotations

import os


def cuda_visible_devices() -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES, or None when it is not set."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


def gpu_of_local_rank(local_rank: int) -> str:
    """The GPU a rank started by torchrun uses, ``cuda:<LOCAL_RANK>``, named as CUDA_VISIBLE_DEVICES
    names it (its entry at position LOCAL_RANK), or by that index when the variable is not set.

    Raises:
        ValueError: CUDA_VISIBLE_DEVICES lists fewer GPUs than this rank's LOCAL_RANK needs.
    """
    visible = cuda_visible_devices()
    if visible is None:
        return str(local_rank)
    if local_rank >= len(visible):
        raise ValueError(
            f"LOCAL_RANK={local_rank}, but CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} lists "
            f"{len(visible)} GPU(s): start at most {len(visible)} processes per node (torchrun --nproc_per_node)."
        )
    return visible[local_rank]


def usable_gpu_ids() -> list[str]:
    """The GPUs this process may hand out: the visible ones that torch can see."""
    import torch

    count = torch.cuda.device_count()
    visible = cuda_visible_devices()
    return visible[:count] if visible is not None else [str(index) for index in range(count)]
