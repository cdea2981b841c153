"""``prepare_model(parallel_strategy="fsdp")``: the model sharded across the workers.

lockstep shards with FSDP2 (``torch.distributed.fsdp.fully_shard``), on CPU (gloo) and on GPUs
alike: each direct child module that holds parameters becomes a unit of its own, then the whole
model, over a one-dimensional device mesh of every worker (``parallel_strategy_kwargs`` go to
``fully_shard``: ``mesh``, ``reshard_after_forward``, ``mp_policy``, ``offload_policy``, …).
Each worker's parameters are then DTensors holding its shard; save and load them with
``torch.distributed.checkpoint`` (see the checkpoints guide).

Ray Train 2.60 wraps with FSDP1 (``FullyShardedDataParallel``) and passes
``parallel_strategy_kwargs`` to it. A script that passes FSDP1's arguments
(``sharding_strategy``, ``auto_wrap_policy``, ``cpu_offload``, …) keeps that behaviour on GPUs;
on CPU, where FSDP1 does not run, it gets an error that says what to pass instead. (The GPU paths
are written and documented as untested here; ``benchmarks/gpu_check.sh`` runs them where a GPU
is lent.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FSDP1_ARGUMENTS", "FSDP2_ARGUMENTS", "shard_model"]

#: The keyword arguments of ``fully_shard`` (FSDP2).
FSDP2_ARGUMENTS = frozenset(
    {"mesh", "reshard_after_forward", "shard_placement_fn", "mp_policy", "offload_policy", "ignored_params"}
)
#: Keyword arguments only ``FullyShardedDataParallel`` (FSDP1) takes.
FSDP1_ARGUMENTS = frozenset(
    {
        "process_group", "sharding_strategy", "cpu_offload", "auto_wrap_policy", "backward_prefetch",
        "mixed_precision", "ignored_modules", "param_init_fn", "device_id", "sync_module_states",
        "forward_prefetch", "limit_all_gathers", "use_orig_params", "ignored_states", "device_mesh",
    }
)  # fmt: skip


def shard_model(model: torch.nn.Module, device: torch.device, kwargs: dict[str, Any]) -> torch.nn.Module:
    """``model`` sharded across the process group's workers (see the module docstring).

    Raises:
        ValueError: FSDP1's arguments on CPU, or arguments neither FSDP takes.
    """
    fsdp1_only = sorted(set(kwargs) & FSDP1_ARGUMENTS)
    if fsdp1_only:
        if device.type == "cpu":
            raise ValueError(
                f"prepare_model(parallel_strategy='fsdp'): {', '.join(fsdp1_only)} are arguments of torch's FSDP1 "
                "(FullyShardedDataParallel), which needs GPUs. On CPU lockstep shards with FSDP2 "
                "(torch.distributed.fsdp.fully_shard): pass its arguments instead "
                f"({', '.join(sorted(FSDP2_ARGUMENTS))}), or none."
            )
        return _fsdp1(model, device, kwargs)
    unknown = sorted(set(kwargs) - FSDP2_ARGUMENTS)
    if unknown:
        raise ValueError(
            f"prepare_model(parallel_strategy='fsdp'): {', '.join(unknown)} are not arguments of "
            f"torch.distributed.fsdp.fully_shard ({', '.join(sorted(FSDP2_ARGUMENTS))}) nor of FSDP1."
        )
    return _fully_sharded(model, device, kwargs)


def _fully_sharded(model: torch.nn.Module, device: torch.device, kwargs: dict[str, Any]) -> torch.nn.Module:
    """FSDP2: each direct child with parameters a unit of its own, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    options = dict(kwargs)
    if "mesh" not in options:
        options["mesh"] = init_device_mesh(device.type, (dist.get_world_size(),))
    for child in model.children():
        if any(parameter.requires_grad for parameter in child.parameters()):
            fully_shard(child, **options)
    fully_shard(model, **options)
    return model


def _fsdp1(model: torch.nn.Module, device: torch.device, kwargs: dict[str, Any]) -> torch.nn.Module:
    """FSDP1 with Ray Train's defaults (GPU only; untested without a GPU)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    options = dict(kwargs)
    options.setdefault("device_id", device)
    return FullyShardedDataParallel(model, **options)
