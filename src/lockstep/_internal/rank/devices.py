"""GPU ids as CUDA_VISIBLE_DEVICES names them (indices, or GPU-/MIG- UUIDs)."""

from __future__ import annotations

import os


def cuda_visible_devices() -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES, or None when it is not set."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [item.strip() for item in value.split(",") if item.strip()]


def usable_gpu_ids() -> list[str]:
    """The GPUs this process may hand out: the visible ones that torch can see."""
    import torch

    count = torch.cuda.device_count()
    visible = cuda_visible_devices()
    return visible[:count] if visible is not None else [str(index) for index in range(count)]
