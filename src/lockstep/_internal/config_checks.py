"""Validation helpers of :mod:`lockstep.config`, among them those of the fields a Ray Train script
may pass that lockstep has no use for, or that Ray Train V1 (``ray.air.config``) had: each is
accepted where it means something here, or refused with a message that says what to use instead
(never a bare ``TypeError``)."""

from __future__ import annotations

import math
import numbers
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
EXECUTORS = ("auto", "local", "ray")
_RUN_NAME_FORBIDDEN = re.compile(r"[/\\]|^\.\.?$|\.\.")


def check_num_workers(num_workers: Any) -> None:
    """``ScalingConfig.num_workers``: an int >= 0 (0: local mode) or a (min, max) pair."""
    if isinstance(num_workers, (tuple, list)):
        if (
            len(num_workers) != 2
            or not all(_is_int_at_least(count, 1) for count in num_workers)
            or num_workers[0] > num_workers[1]
        ):
            raise ValueError(
                f"ScalingConfig.num_workers=(min, max) needs two ints with 1 <= min <= max, got {num_workers!r}; "
                "for local mode (the train function in this process) pass num_workers=0."
            )
        return
    if not _is_int_at_least(num_workers, 0):
        raise ValueError(
            f"ScalingConfig.num_workers must be an int >= 1, 0 for local mode (the train function in this "
            f"process), or a (min, max) pair; got {num_workers!r} ({type(num_workers).__name__})."
        )


def _is_int_at_least(value: Any, least: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and int(value) >= least


def check_resources(field_name: str, resources: dict[str, float] | None) -> None:
    """A ScalingConfig resources dict: string keys, numbers >= 0."""
    if resources is None:
        return
    if not isinstance(resources, dict):
        raise ValueError(f"ScalingConfig.{field_name} must be a dict like {{'CPU': 1}}, got {resources!r}.")
    for key, amount in resources.items():
        if not isinstance(key, str):
            raise ValueError(f"ScalingConfig.{field_name} keys must be strings, got {key!r}.")
        if isinstance(amount, bool) or not isinstance(amount, numbers.Real) or math.isnan(amount) or amount < 0:
            raise ValueError(f"ScalingConfig.{field_name}[{key!r}] must be a number >= 0, got {amount!r}.")


def check_ray_only_placement(label_selector: Any, use_tpu: Any, topology: Any) -> None:
    """Refuse Ray Train's node-label and TPU placement, which lockstep has no equivalent of."""
    if label_selector:
        raise ValueError(
            f"ScalingConfig.label_selector={label_selector!r} is not supported: lockstep places Ray workers by "
            "resources only. Give the nodes you want a custom resource (ray start --resources='{\"pool_a\": 8}') "
            "and ask for it: resources_per_worker={'CPU': 1, 'pool_a': 1}; or use accelerator_type=."
        )
    if use_tpu is not False:
        raise ValueError(
            f"ScalingConfig.use_tpu={use_tpu!r}: lockstep runs torch.distributed on CPUs or CUDA GPUs, "
            "not TPUs. Drop use_tpu (use use_gpu=True for GPUs)."
        )
    if topology is not None:
        raise ValueError(
            f"ScalingConfig.topology={topology!r} is a TPU slice topology, and lockstep does not run on TPUs; "
            "drop topology (use accelerator_type= to ask for a GPU type)."
        )


def check_fail_fast(fail_fast: Any, max_failures: Any) -> None:
    """``FailureConfig(fail_fast=)``: for one run, "stop at the first failure" is max_failures=0."""
    if fail_fast not in (False, True, "raise"):
        raise ValueError(f"FailureConfig.fail_fast must be True, False or 'raise', got {fail_fast!r}.")
    if fail_fast and max_failures != 0:
        raise ValueError(
            f"FailureConfig(fail_fast={fail_fast!r}, max_failures={max_failures!r}) contradict each other: for "
            "one training run fail_fast means max_failures=0. Drop fail_fast and keep max_failures."
        )


def check_v1_checkpoint_fields(checkpoint_frequency: Any, checkpoint_at_end: Any) -> None:
    """``CheckpointConfig(checkpoint_frequency=, checkpoint_at_end=)`` don't apply to a train
    function (as in Ray Train): only their "off" values are accepted."""
    if checkpoint_frequency not in (0, None):
        raise ValueError(
            f"CheckpointConfig.checkpoint_frequency={checkpoint_frequency!r} does not apply to a train function: "
            "checkpoint where you want in it, e.g. every N epochs "
            "`lockstep.report(metrics, checkpoint=lockstep.Checkpoint.from_directory(folder))`. "
            "Drop checkpoint_frequency."
        )
    if checkpoint_at_end:
        raise ValueError(
            "CheckpointConfig.checkpoint_at_end=True does not apply to a train function: pass a checkpoint to "
            "the last `lockstep.report(metrics, checkpoint=...)` of the train function instead. "
            "Drop checkpoint_at_end."
        )


def storage_path_from_local_dir(storage_path: Any, local_dir: Any) -> Any:
    """``RunConfig(local_dir=)`` (Ray Train V1) is ``storage_path``: the storage path to use."""
    if local_dir is None:
        return storage_path
    local_dir = os.fspath(local_dir)
    if storage_path is not None and os.fspath(storage_path) != local_dir:
        raise ValueError(
            f"RunConfig got storage_path={storage_path!r} and local_dir={local_dir!r}: local_dir is the old "
            "name of storage_path. Pass storage_path only."
        )
    warnings.warn(
        "RunConfig(local_dir=...) is the old name of storage_path=; use storage_path.", DeprecationWarning, stacklevel=4
    )
    return local_dir


def check_v1_run_fields(
    stop: Any, log_to_file: Any, sync_config: Any, progress_reporter: Any, worker_runtime_env: Any
) -> None:
    """Check ``stop``; refuse the RunConfig fields lockstep has no equivalent of, saying what to use."""
    check_stop(stop)
    if log_to_file not in (None, True, False):
        raise ValueError(
            f"RunConfig(log_to_file={log_to_file!r}): lockstep always writes each rank's output to "
            "<storage_path>/<name>/logs/rank_<r>.log and cannot rename those files; drop log_to_file "
            "(worker_output= chooses what the console shows)."
        )
    if sync_config is not None:
        raise ValueError(
            "RunConfig(sync_config=...): lockstep has no sync step, ranks write checkpoints straight to "
            "storage_path (a local or shared folder, or a URI such as s3://bucket/prefix). Drop sync_config."
        )
    if progress_reporter is not None:
        raise ValueError(
            "RunConfig(progress_reporter=...) is Ray Tune's: lockstep shows its own progress line "
            "(verbose=0 hides it); for your own reporting pass callbacks=[lockstep.callbacks.Callback subclass]."
        )
    if worker_runtime_env:
        raise ValueError(
            "RunConfig(worker_runtime_env=...) is not supported: on Ray give the runtime env to the whole "
            "job, ray.init(runtime_env=...); local workers inherit this process's environment, so set "
            "os.environ[...] before fit()."
        )


def check_stop(stop: Any) -> None:
    """``RunConfig(stop=)`` is None, a dict of metric name -> number, or a function
    ``(report_index, metrics) -> bool``.

    Raises:
        ValueError: it is something else, naming what.
    """
    if stop is None or callable(stop):
        return
    if not isinstance(stop, Mapping) or not stop:
        raise ValueError(
            f"RunConfig(stop={stop!r}): give a dict of metric -> threshold (the run stops once a reported value "
            "is >= it, e.g. {'training_iteration': 10}) or a function (report_index, metrics) -> bool."
        )
    for key, threshold in stop.items():
        if not isinstance(key, str) or not isinstance(threshold, numbers.Real) or isinstance(threshold, bool):
            raise ValueError(
                f"RunConfig(stop=...): {key!r}: {threshold!r} must be a metric name and a number; for other "
                "conditions (e.g. a loss going below a value) pass a function (report_index, metrics) -> bool."
            )


def check_placement(scaling: Any) -> None:
    """``ScalingConfig``: GPUs asked for with ``use_gpu`` and only with it; a known placement strategy."""
    if scaling.resources_per_worker and not scaling.use_gpu and scaling.resources_per_worker.get("GPU", 0) > 0:
        raise ValueError(
            "ScalingConfig.resources_per_worker asks for GPUs but use_gpu=False: "
            "set use_gpu=True, or remove 'GPU' from resources_per_worker."
        )
    if scaling.resources_per_worker and scaling.use_gpu and scaling.resources_per_worker.get("GPU", 1) == 0:
        raise ValueError(
            "ScalingConfig(use_gpu=True) but resources_per_worker gives each worker 'GPU': 0: "
            "set use_gpu=False, or ask for a positive number of GPUs per worker."
        )
    if scaling.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(
            f"ScalingConfig.placement_strategy={scaling.placement_strategy!r} is unknown; "
            f"choose one of {', '.join(PLACEMENT_STRATEGIES)}."
        )


def check_executor_fields(scaling: Any) -> None:
    """``ScalingConfig``: the executor, Ray address, accelerator type and placement timeout."""
    if scaling.executor not in EXECUTORS:
        raise ValueError(
            f"ScalingConfig.executor={scaling.executor!r} is unknown; choose one of {', '.join(EXECUTORS)}."
        )
    if scaling.ray_address is not None and not (isinstance(scaling.ray_address, str) and scaling.ray_address):
        raise ValueError(
            "ScalingConfig.ray_address must be a non-empty string like 'auto' or 'host:6379', got "
            f"{scaling.ray_address!r}."
        )
    if scaling.ray_address is not None and scaling.executor == "local":
        raise ValueError("ScalingConfig: ray_address is set but executor='local'; drop one of them.")
    if scaling.accelerator_type is not None and not (
        isinstance(scaling.accelerator_type, str) and scaling.accelerator_type
    ):
        raise ValueError(
            f"ScalingConfig.accelerator_type must be a name like 'A100', got {scaling.accelerator_type!r}."
        )
    timeout = scaling.placement_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"ScalingConfig.placement_timeout_s must be a number of seconds > 0, got {timeout!r}.")


def check_run_name(name: Any) -> None:
    """``RunConfig.name``: None, or a plain folder name."""
    if name is not None and (not isinstance(name, str) or not name or _RUN_NAME_FORBIDDEN.search(name)):
        raise ValueError(
            f"RunConfig.name={name!r} must be a plain folder name: non-empty, with no '/', "
            "'\\' or '..'. Put the parent folders in storage_path instead."
        )


def check_metrics_port(port: Any, where: str) -> None:
    """A metrics port: ``None`` (off), ``0`` (a free port) or a TCP port number.

    Raises:
        ValueError: anything else, naming ``where`` it came from.
    """
    if port is None:
        return
    if not _is_int_at_least(port, 0) or int(port) > 65535:
        raise ValueError(
            f"{where} must be a TCP port number (1-65535), 0 for a free port, or None to leave the metrics "
            f"off; got {port!r}."
        )


def check_storage_retry_s(value: Any) -> None:
    """``RunConfig.storage_retry_s``: a finite number of seconds >= 0.

    Raises:
        ValueError: anything else.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"RunConfig.storage_retry_s must be a number of seconds >= 0: how long lockstep retries a storage "
            f"operation that fails with transient errors (default 300; 0 never retries); got {value!r}."
        )


def check_hang_settings(timeout_s: Any, step_multiple: Any, first_step_timeout_s: Any) -> None:
    """``FailureConfig``'s hang detector settings: seconds > 0 (or None: off), a multiple >= 1."""
    for name, value in (("hang_timeout_s", timeout_s), ("hang_first_step_timeout_s", first_step_timeout_s)):
        if value is not None and not _positive_number(value):
            raise ValueError(
                f"FailureConfig.{name} must be a number of seconds > 0, or None to turn it off; got {value!r}."
            )
    if not _positive_number(step_multiple) or step_multiple < 1:
        raise ValueError(
            f"FailureConfig.hang_step_multiple must be a number >= 1 (how many median step times without "
            f"progress make a hang); got {step_multiple!r}."
        )


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def check_failure_config(config: Any) -> None:
    """Every field of a ``FailureConfig``."""
    check_fail_fast(config.fail_fast, config.max_failures)
    check_hang_settings(config.hang_timeout_s, config.hang_step_multiple, config.hang_first_step_timeout_s)
    if (
        isinstance(config.preemption_grace_s, bool)
        or not isinstance(config.preemption_grace_s, (int, float))
        or config.preemption_grace_s < 0
    ):
        raise ValueError(
            f"FailureConfig.preemption_grace_s must be a number of seconds >= 0, got {config.preemption_grace_s!r}."
        )
    if (
        isinstance(config.max_preemption_failures, bool)
        or not isinstance(config.max_preemption_failures, int)
        or config.max_preemption_failures < -1
    ):
        raise ValueError(
            f"FailureConfig.max_preemption_failures must be an int >= 0, or -1; got {config.max_preemption_failures!r}."
        )
    if config.report_timeout_s is not None and (
        isinstance(config.report_timeout_s, bool)
        or not isinstance(config.report_timeout_s, (int, float))
        or config.report_timeout_s <= 0
    ):
        raise ValueError(
            f"FailureConfig.report_timeout_s must be a number of seconds > 0 or None, got {config.report_timeout_s!r}."
        )
    if isinstance(config.max_failures, bool) or not isinstance(config.max_failures, int) or config.max_failures < -1:
        raise ValueError(
            f"FailureConfig.max_failures must be an int >= 0, or -1 for no limit; got {config.max_failures!r}."
        )


def check_checkpoint_config(config: Any) -> None:
    """Every field of a ``CheckpointConfig``."""
    check_v1_checkpoint_fields(config.checkpoint_frequency, config.checkpoint_at_end)
    if config.num_to_keep is not None and (
        isinstance(config.num_to_keep, bool) or not isinstance(config.num_to_keep, int) or config.num_to_keep < 1
    ):
        raise ValueError(
            f"CheckpointConfig.num_to_keep must be None (keep all) or an int >= 1, got {config.num_to_keep!r}; "
            "to keep no checkpoints, don't pass one to report()."
        )
    if config.checkpoint_score_order not in ("max", "min"):
        raise ValueError(
            f"CheckpointConfig.checkpoint_score_order must be 'max' or 'min', got {config.checkpoint_score_order!r}."
        )
    if config.checkpoint_score_attribute is not None and not isinstance(config.checkpoint_score_attribute, str):
        raise ValueError(
            "CheckpointConfig.checkpoint_score_attribute must be a metric name (str), "
            f"got {config.checkpoint_score_attribute!r}."
        )
