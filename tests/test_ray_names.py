"""Ray Train's names under lockstep: every public name of ``ray.train``, ``ray.train.torch`` and
``ray.air.session`` (Ray 2.60) is provided, a deprecated stand-in that says what to use, or
listed as not provided (``lockstep._internal.ray_compat.ray_names``, which the docs read); the V1-era
config fields work or say what replaced them; ``fit()`` fails with Ray's error types."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT

import lockstep
from lockstep import (
    CheckpointConfig,
    ControllerError,
    FailureConfig,
    LoggingConfig,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
    WorkerError,
    WorkerGroupError,
)
from lockstep._internal.ray_compat.ray_names import RAY_NAMES, NameStatus
from lockstep.errors import WorkerFailure


def resolve(dotted: str) -> Any:
    """``lockstep.torch.prepare_model`` -> the object (the longest importable module, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(dotted)


def ray_public_names(module_name: str) -> set[str]:
    """The public names of a Ray module: its ``__all__``; for ``ray.air.session`` (which has
    none), the functions Ray marks as public API."""
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        return set(module.__all__)
    return {
        name
        for name, value in vars(module).items()
        if inspect.isfunction(value)
        and getattr(value, "_annotated", None) == name
        and getattr(getattr(value, "_annotated_type", None), "name", "") == "PUBLIC_API"
    }


def entries(*statuses: str) -> list[tuple[str, str, NameStatus]]:
    return [
        (module, name, status)
        for module, names in RAY_NAMES.items()
        for name, status in names.items()
        if status.status in statuses
    ]


# -- the map of names ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module_name", sorted(RAY_NAMES))
def test_every_public_ray_name_is_in_the_map(module_name: str) -> None:
    assert set(RAY_NAMES[module_name]) == ray_public_names(module_name), (
        "update lockstep._internal.ray_compat.ray_names: Ray's public names changed"
    )


@pytest.mark.parametrize("module_name, name, status", entries("provided", "deprecated"))
def test_provided_and_deprecated_names_import_from_lockstep(module_name: str, name: str, status: NameStatus) -> None:
    assert status.lockstep.rsplit(".", 1)[-1] == name
    resolve(status.lockstep)
    lockstep_module = module_name.replace("ray.train", "lockstep").replace("ray.air.session", "lockstep.session")
    exec(f"from {lockstep_module} import {name}", {})  # the import line a moved script has


#: What a Ray Train name may need that lockstep does not have (issue #23's "Done when").
NOT_HERE = ("TPU", "node label")


def test_only_names_needing_what_lockstep_lacks_are_not_provided_and_they_say_why() -> None:
    for module_name, name, status in entries("not provided"):
        lockstep_module = importlib.import_module(module_name.replace("ray.train", "lockstep"))
        assert not hasattr(lockstep_module, name), f"{module_name}.{name} is said not to be provided, yet it is"
        assert any(reason in status.note for reason in NOT_HERE), (
            f"{module_name}.{name} is not provided, but not for want of {' or '.join(NOT_HERE)}: {status.note}"
        )


# -- deprecated names fail on use, naming the replacement -------------------------------------------


def _call(path: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
    return lambda: resolve(path)(*args, **kwargs)


@pytest.mark.parametrize(
    "use, replacement",
    [
        (_call("lockstep.torch.accelerate", amp=True), "torch.autocast"),
        (_call("lockstep.torch.backward", None), "loss.backward()"),
        (_call("lockstep.torch.prepare_optimizer", None), "the optimizer as it is"),
        (_call("lockstep.torch.TorchCheckpoint"), "lockstep.Checkpoint"),
        (lambda: resolve("lockstep.torch.TorchCheckpoint").from_state_dict({}), "lockstep.Checkpoint"),
        (_call("lockstep.session.get_trial_dir"), "train_loop_config"),
        (_call("lockstep.session.get_trial_id"), "get_experiment_name()"),
        (_call("lockstep.session.get_run_id"), "get_experiment_name()"),
        (_call("lockstep.session.get_trial_resources"), "get_device()"),
    ],
)
def test_deprecated_names_fail_on_use_with_the_replacement(use: Callable[[], Any], replacement: str) -> None:
    with pytest.raises(DeprecationWarning, match="deprecated in Ray Train") as raised:
        use()
    assert replacement in str(raised.value)


def test_sync_config_says_there_is_nothing_to_sync() -> None:
    with pytest.raises(ValueError, match="storage_path"):
        lockstep.SyncConfig(sync_period=300)


@pytest.mark.parametrize("module_name, name, status", entries("deprecated"))
def test_every_deprecated_name_raises_when_called(module_name: str, name: str, status: NameStatus) -> None:
    with pytest.raises((DeprecationWarning, ValueError)):
        resolve(status.lockstep)()


# -- V1-era and Ray-only config fields: they work, or say what to use -----------------------------


@pytest.mark.parametrize(
    "make, error, says",
    [
        (lambda: RunConfig(stop=["training_iteration"]), ValueError, "a dict of metric -> threshold"),
        (lambda: RunConfig(log_to_file="train.log"), ValueError, "logs/rank_<r>.log"),
        (lambda: RunConfig(log_to_file=("out", "err")), ValueError, "drop log_to_file"),
        (lambda: RunConfig(sync_config=object()), ValueError, "storage_path"),
        (lambda: RunConfig(progress_reporter=object()), ValueError, "verbose=0"),
        (lambda: RunConfig(worker_runtime_env={"env_vars": {"A": "1"}}), ValueError, "ray.init(runtime_env=...)"),
        (lambda: RunConfig(storage_path="/a", local_dir="/b"), ValueError, "Pass storage_path only"),
        (lambda: RunConfig(logging_config="DEBUG"), ValueError, "LoggingConfig"),
        (lambda: LoggingConfig(log_level="LOUD"), ValueError, "DEBUG, INFO"),
        (lambda: CheckpointConfig(checkpoint_frequency=2), ValueError, "lockstep.report(metrics, checkpoint="),
        (lambda: CheckpointConfig(checkpoint_at_end=True), ValueError, "last `lockstep.report"),
        (lambda: FailureConfig(fail_fast=True, max_failures=2), ValueError, "fail_fast means max_failures=0"),
        (lambda: FailureConfig(fail_fast="sometimes"), ValueError, "True, False or 'raise'"),
        (lambda: ScalingConfig(label_selector={"zone": "a"}), ValueError, "resources_per_worker"),
        (lambda: ScalingConfig(use_tpu=True), ValueError, "use_gpu=True"),
        (lambda: ScalingConfig(topology="4x4"), ValueError, "accelerator_type"),
    ],
)
def test_fields_without_a_meaning_here_say_what_to_use(make: Callable[[], Any], error: type, says: str) -> None:
    with pytest.raises(error) as raised:
        make()
    assert says in str(raised.value)


@pytest.mark.parametrize(
    "make, check",
    [
        (lambda: RunConfig(verbose=0), lambda config: config.verbose == 0),
        (lambda: RunConfig(log_to_file=True), lambda config: config.log_to_file is True),
        (lambda: RunConfig(worker_runtime_env={}), lambda config: True),
        (
            lambda: CheckpointConfig(checkpoint_frequency=0, checkpoint_at_end=False),
            lambda config: config.num_to_keep is None,
        ),
        (lambda: FailureConfig(fail_fast=True), lambda config: config.max_failures == 0),
        (lambda: FailureConfig(fail_fast="raise"), lambda config: config.max_failures == 0),
        (
            lambda: ScalingConfig(num_workers=2, use_tpu=False, label_selector=None, topology=None),
            lambda config: config.max_workers == 2,
        ),
        (
            lambda: ScalingConfig(num_workers=0),
            lambda config: (config.min_workers, config.max_workers, config.elastic) == (0, 0, False),
        ),
    ],
)
def test_fields_that_mean_something_here_work(make: Callable[[], Any], check: Callable[[Any], bool]) -> None:
    assert check(make())


def test_local_dir_is_storage_path_with_a_deprecation_warning(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match="use storage_path"):
        config = RunConfig(local_dir=tmp_path)
    assert config.storage_path == str(tmp_path)
    with pytest.warns(DeprecationWarning):
        assert RunConfig(storage_path=str(tmp_path), local_dir=str(tmp_path)).storage_path == str(tmp_path)


def test_logging_config_sets_lockstep_log_level() -> None:
    logger = logging.getLogger("lockstep")
    before = logger.level
    try:
        RunConfig(logging_config=LoggingConfig(log_level="debug"))
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)


# -- errors -----------------------------------------------------------------------------------------


def fail_on_rank_one_after_a_collective() -> None:
    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)  # the process group from TorchConfig("cpu:gloo,cuda:nccl") works
    lockstep.report({"world": float(total.item())})
    if lockstep.get_context().get_world_rank() == 1:
        raise ValueError("bad batch on purpose")
    lockstep.report({"never": 1})


@pytest.mark.timeout(120)
def test_a_failing_rank_is_a_worker_group_error_with_its_worker_failure(storage_path: str) -> None:
    from lockstep.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        fail_on_rank_one_after_a_collective,
        torch_config=TorchConfig(backend="cpu:gloo,cuda:nccl"),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="fails", storage_path=storage_path),
    )
    with pytest.raises(WorkerGroupError) as caught:
        trainer.fit()
    error = caught.value
    assert isinstance(error, TrainingFailedError) and list(error.worker_failures) == [1]
    failure = error.worker_failures[1]
    assert isinstance(failure, WorkerError) and isinstance(failure, ValueError)
    assert (failure.rank, failure.error_type, failure.message) == (1, "ValueError", "bad batch on purpose")
    assert str(failure) == "ValueError: bad batch on purpose"
    assert "in fail_on_rank_one_after_a_collective" in failure.traceback
    assert error.failures[1].error_type == "ValueError"
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is WorkerGroupError and str(again) == str(error) and again.failures == error.failures
    assert isinstance(again.worker_failures[1], ValueError) and again.worker_failures[1].traceback == failure.traceback
    assert lockstep.Result.from_path(Path(storage_path, "fails")).metrics == {"world": 2.0}


def test_worker_group_error_takes_exceptions_as_ray_does() -> None:
    try:
        raise KeyError("missing column")
    except KeyError as raised:
        error = WorkerGroupError("rank 0 failed", {0: raised, 1: WorkerFailure(1, "WorkerDied", "killed")})
    assert isinstance(error.worker_failures[0], KeyError) and "missing column" in error.worker_failures[0].message
    assert "Traceback" in error.worker_failures[0].traceback
    assert type(error.worker_failures[1]) is WorkerError and str(error.worker_failures[1]) == "WorkerDied: killed"
    assert pickle.loads(pickle.dumps(error)).failures == error.failures


class _Unpicklable(Exception):
    def __reduce__(self) -> Any:
        raise TypeError("not picklable")


def test_a_driver_that_cannot_go_on_is_a_controller_error(tmp_path: Path) -> None:
    from lockstep._internal.persist.storage import RunStorage
    from lockstep._internal.run.controller import Controller
    from lockstep._internal.run.run_record import RunRecorder
    from lockstep._internal.run.worker_group import GroupFactory

    def no_group(size: int) -> Any:
        raise _Unpicklable("the cluster went away")

    recorder = RunRecorder(RunStorage.for_run(str(tmp_path), "run"), CheckpointConfig(), 2)
    recorder.open()
    with pytest.raises(ControllerError) as caught:
        Controller(GroupFactory("broken", no_group, 2, 2, None), recorder, max_failures=0).run()
    error = caught.value
    assert isinstance(error, TrainingFailedError) and not isinstance(error, WorkerGroupError)
    assert str(error).startswith("The driver could not go on: _Unpicklable: the cluster went away")
    assert isinstance(error.controller_failure, _Unpicklable) and error.__cause__ is error.controller_failure
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is ControllerError and str(again) == str(error)
    assert repr(again.controller_failure) == "RuntimeError('_Unpicklable: the cluster went away')"


def test_controller_error_takes_an_exception_as_ray_does() -> None:
    error = ControllerError(OSError("disk full"))
    assert error.controller_failure.args == ("disk full",) and "OSError: disk full" in str(error)
    assert isinstance(pickle.loads(pickle.dumps(error)).controller_failure, OSError)


# -- importing ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_import_lockstep_imports_neither_torch_nor_the_integrations() -> None:
    code = (
        "import sys, lockstep\n"
        "from lockstep import WorkerGroupError, ControllerError, TRAIN_DATASET_KEY, BackendConfig, SyncConfig\n"
        "heavy = [m for m in ('torch', 'lightning', 'pytorch_lightning', 'transformers', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert TRAIN_DATASET_KEY == 'train'\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=50,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert completed.returncode == 0, completed.stderr


def test_integration_modules_load_on_first_use() -> None:
    for name in ("torch", "collective", "huggingface"):
        assert getattr(lockstep, name).__name__ == f"lockstep.{name}"
    with pytest.raises(AttributeError, match="no attribute 'tune'"):
        lockstep.tune  # noqa: B018


@pytest.mark.timeout(60)
def test_the_ray_train_api_map_is_up_to_date() -> None:
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "docs" / "make_ray_train_api.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert completed.returncode == 0, (
        "docs/ray_train_api.md is stale: run `python docs/make_ray_train_api.py`\n"
        + completed.stdout
        + completed.stderr
    )
