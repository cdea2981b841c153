"""Config objects refuse bad values with a ValueError that names the field."""

from __future__ import annotations

import pytest

from lockstep import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from lockstep.torch import TorchConfig


@pytest.mark.parametrize("num_workers", [-1, 1.5, "2", True, None, (0, 2), (3, 2)])
def test_num_workers_must_be_an_int_at_least_0_or_a_min_max_pair(num_workers: object) -> None:
    with pytest.raises(ValueError, match="num_workers"):
        ScalingConfig(num_workers=num_workers)  # type: ignore[arg-type]


def test_num_workers_0_is_local_mode() -> None:
    config = ScalingConfig(num_workers=0)
    assert (config.min_workers, config.max_workers, config.elastic) == (0, 0, False)


def test_gpu_resources_need_use_gpu() -> None:
    with pytest.raises(ValueError, match="use_gpu=True"):
        ScalingConfig(num_workers=1, resources_per_worker={"GPU": 1})


def test_negative_resources_refused() -> None:
    with pytest.raises(ValueError, match=r"resources_per_worker\['CPU'\]"):
        ScalingConfig(num_workers=1, resources_per_worker={"CPU": -1})


def test_unknown_placement_strategy_lists_choices() -> None:
    with pytest.raises(ValueError, match="PACK, SPREAD, STRICT_PACK, STRICT_SPREAD"):
        ScalingConfig(num_workers=1, placement_strategy="RANDOM")


def test_worker_resource_defaults() -> None:
    assert ScalingConfig(num_workers=2).worker_resources == {"CPU": 1.0}
    gpu = ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"CPU": 4})
    assert gpu.worker_resources == {"CPU": 4, "GPU": 1.0}
    assert gpu.num_cpus_per_worker == 4 and gpu.num_gpus_per_worker == 1
    # as Ray Train: a GPU worker asks for no CPU unless told, and amounts of 0 are left out
    assert ScalingConfig(num_workers=2, use_gpu=True).worker_resources == {"GPU": 1.0}
    assert ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2, "memory": 0}).worker_resources == {"CPU": 2}
    assert ScalingConfig(num_workers=2, resources_per_worker={"memory": 2**30}).worker_resources == {"memory": 2**30}


@pytest.mark.parametrize("name", ["a/b", "..", "x/../y", "", "a\\b"])
def test_run_name_must_be_a_plain_folder_name(name: str) -> None:
    with pytest.raises(ValueError, match="RunConfig.name"):
        RunConfig(name=name)


def test_run_config_defaults_and_paths() -> None:
    from pathlib import Path

    config = RunConfig(storage_path=Path("/tmp/x"))
    assert config.storage_path == "/tmp/x"
    assert config.failure_config.max_failures == 0
    assert config.checkpoint_config.num_to_keep is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_to_keep": 0}, "num_to_keep"),
        ({"num_to_keep": -2}, "num_to_keep"),
        ({"checkpoint_score_order": "best"}, "checkpoint_score_order"),
    ],
)
def test_checkpoint_config_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CheckpointConfig(**kwargs)


@pytest.mark.parametrize("value", [-2, 1.5, "3"])
def test_failure_config_validation(value: object) -> None:
    with pytest.raises(ValueError, match="max_failures"):
        FailureConfig(max_failures=value)  # type: ignore[arg-type]


def test_torch_config_validation_and_backend_choice() -> None:
    with pytest.raises(ValueError, match="backend"):
        TorchConfig(backend="carrier-pigeon")
    with pytest.raises(ValueError, match="init_method"):
        TorchConfig(init_method="file")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        TorchConfig(timeout_s=0)
    assert TorchConfig().resolved_backend(use_gpu=True) == "nccl"
    assert TorchConfig().resolved_backend(use_gpu=False) == "gloo"
    assert TorchConfig(backend="gloo").resolved_backend(use_gpu=True) == "gloo"


def test_torch_config_per_device_backends() -> None:
    both = TorchConfig(backend="cpu:gloo,cuda:nccl")
    assert both.resolved_backend(use_gpu=False) == "gloo"
    assert both.resolved_backend(use_gpu=True) == "cpu:gloo,cuda:nccl", "torch gets both: CPU tensors over gloo"
    with pytest.raises(ValueError, match="no backend for CPU workers"):
        TorchConfig(backend="cuda:nccl").resolved_backend(use_gpu=False)
    for unknown in ("gloo,nccl", "tpu:gloo", "cpu:pigeon", "cpu:gloo,"):
        with pytest.raises(ValueError, match="per-device pairs such as 'cpu:gloo,cuda:nccl'"):
            TorchConfig(backend=unknown)


def test_legacy_import_paths() -> None:
    import lockstep as train
    from lockstep.config import ScalingConfig as LegacyScalingConfig

    assert LegacyScalingConfig is ScalingConfig
    assert train.torch.TorchTrainer.__name__ == "TorchTrainer"
