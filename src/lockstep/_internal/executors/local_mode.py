"""Local mode: ``ScalingConfig(num_workers=0)`` runs the train function in this very process, as
Ray Train 2.x does, so that a debugger's breakpoints in it stop the driver and Ctrl-C reaches it.

The train function runs on the main thread as the one rank (world size 1, rank 0) and the
controller on a thread beside it. They talk over the usual channel (a loopback socket), exactly
as rank 0 does with its own controller under torchrun, so ``report()``, checkpoints, the run
record and the :class:`~lockstep.Result` mean what they mean with worker processes. Nothing is
pickled: the train function, its config and rank 0's return value stay the objects they are.

What differs from a run with workers:

- No ``torch.distributed`` process group is created and the backend's worker set-up
  (``TorchConfig``) is skipped, as in Ray Train's local mode: ``prepare_model`` then moves the
  model to the device without wrapping it, ``prepare_data_loader`` adds no sampler.
- No restarts: a failure of the train function ends the run (``FailureConfig.max_failures``
  does not apply), since a restart in the same process would inherit whatever state the
  failure left behind.
- No hang detector (``FailureConfig.hang_timeout_s`` does not apply): a train function
  stopped at a breakpoint is not hung.
- The device is the current CUDA device with ``use_gpu=True``, else the CPU.
- Ray Datasets are handed over whole (one iterator each), as the only rank's shard.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from lockstep._internal.executors.attached_group import AttachedGroup
from lockstep._internal.executors.base import Executor
from lockstep._internal.executors.beside import drive_beside_rank_0
from lockstep._internal.rank.rank_env import RankEnv
from lockstep._internal.run.preemption import Preemption, PreemptionStop, rank_signals
from lockstep._internal.wire import protocol
from lockstep._internal.wire.channel import WorkerChannel, connect_to_driver
from lockstep.backend import BackendConfig

if TYPE_CHECKING:
    from lockstep._internal.payload import TrainJob
    from lockstep._internal.run.driver import RunDriver
    from lockstep.config import ScalingConfig
    from lockstep.result import Result

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class LocalModeExecutor(Executor):
    """The train function runs in this process (local mode); a thread drives the run.

    Args:
        scaling: The run's ScalingConfig (``num_workers=0``).
        ray_datasets: Ray Datasets passed to the trainer; each is the only rank's shard.

    Raises:
        ValueError: ``scaling`` also asks for Ray, which local mode can't honour.
    """

    name = "local_mode"

    def __init__(self, scaling: ScalingConfig, ray_datasets: Mapping[str, Any]) -> None:
        check_local_mode(scaling)
        self.use_gpu = scaling.use_gpu
        self.ray_datasets = dict(ray_datasets)

    def run_scaling(self, scaling: ScalingConfig) -> ScalingConfig:
        """One worker: the train function in this process."""
        return dataclasses.replace(scaling, num_workers=1)

    def reserve(self, run_name: str) -> AbstractContextManager[None]:
        """This process's one local-mode run (see :func:`claim_local_mode`)."""
        return local_mode_claimed(run_name)

    def launch(self, job: TrainJob, driver: RunDriver) -> Result:
        """Run the train function here while a thread drives the run; return the Result.

        Raises:
            TrainingFailedError: the train function failed.
            KeyboardInterrupt: the train function was interrupted (after the run is recorded
                as failed).
        """
        if driver.run_config.failure_config.max_failures != 0:
            logger.info(
                "Local mode (num_workers=0) does not restart a failed train function: "
                "FailureConfig.max_failures is not used."
            )
        group = AttachedGroup(LOOPBACK, 1, "the train function's channel closed before it finished")
        # no process group here, so nothing can get stuck: no announce; and no hang detector: a
        # breakpoint in the train function is no hang
        interrupted, thread = drive_beside_rank_0(
            driver,
            self.name,
            group,
            lambda controller: self._run_rank(job, group, controller.preemption),
            watch_hangs=False,
        )
        if interrupted is not None:
            raise interrupted
        return thread.outcome()

    def _run_rank(self, job: TrainJob, group: AttachedGroup, preemption: Preemption) -> BaseException | None:
        """Run the train function on this thread as rank 0, connected to ``group``'s channel.
        Return the KeyboardInterrupt (or alike: a SIGHUP's HangUp, after ``preemption`` told the
        controller) that stopped it, to raise once the run is recorded."""
        from lockstep._internal.rank.session_state import set_session
        from lockstep._internal.rank.worker import describe_failure, run_rank

        channel = connect_to_driver(0, group.listener.worker_env(0))
        interrupted: BaseException | None = None
        try:
            with rank_signals(
                channel, 0, hang_up=True, controller=preemption
            ):  # SIGTERM: a notice; SIGHUP: interrupted
                group.keep_return_value(
                    run_rank(
                        self._rank_env(),
                        channel,
                        lambda: _without_worker_setup(job),
                        {name: dataset.iterator() for name, dataset in self.ray_datasets.items()},
                    )
                )
            outcome: Any = protocol.Finished(0, None)
        except BaseException as error:  # noqa: BLE001 - the controller must hear of every failure
            error.__traceback__ = error.__traceback__.tb_next if error.__traceback__ else None  # not this frame
            outcome = protocol.Failed(describe_failure(0, error))
            interrupted = None if isinstance(error, (Exception, PreemptionStop)) else error
        finally:
            set_session(None)
        _send_last(channel, outcome)
        return interrupted

    def _rank_env(self) -> RankEnv:
        """The only rank: world size 1, this process's threads and (with use_gpu) current GPU."""
        import torch

        return RankEnv(
            world_rank=0,
            world_size=1,
            local_rank=0,
            local_world_size=1,
            node_rank=0,
            master_addr=LOOPBACK,
            master_port=0,
            threads=torch.get_num_threads(),
            gpu_ids=current_gpu_id() if self.use_gpu else (),
        )


def check_local_mode(scaling: ScalingConfig) -> None:
    """Local mode runs here; a config that also asks for Ray contradicts it.

    Raises:
        ValueError: ``executor='ray'`` or ``ray_address`` is set with ``num_workers=0``.
    """
    if scaling.wants_ray:
        raise ValueError(
            "ScalingConfig(num_workers=0) runs the train function in this process (local mode), so "
            f"executor={scaling.executor!r} / ray_address={scaling.ray_address!r} can't apply: drop them, "
            "or set num_workers >= 1 to run workers on Ray."
        )


def current_gpu_id() -> tuple[str, ...]:
    """The current CUDA device, as CUDA_VISIBLE_DEVICES names it; none without CUDA."""
    import torch

    from lockstep._internal.rank.devices import usable_gpu_ids

    if not torch.cuda.is_available():
        logger.warning(
            "ScalingConfig(use_gpu=True) in local mode, but torch sees no GPU: the train function runs on the CPU."
        )
        return ()
    return (usable_gpu_ids()[torch.cuda.current_device()],)


def _without_worker_setup(job: TrainJob) -> TrainJob:
    """The job with no backend set-up: no process group in local mode (as in Ray Train)."""
    return dataclasses.replace(job, backend_config=BackendConfig())


def _send_last(channel: WorkerChannel, outcome: Any) -> None:
    """Tell the controller how the train function ended, and close the channel."""
    try:
        channel.send(outcome)
    except OSError:
        pass  # the controller already stopped (its own failure is raised instead)
    finally:
        channel.close()


_local_mode_lock = threading.Lock()
_local_mode_run: str | None = None  # the local-mode run driven in this process now, if any


@contextmanager
def local_mode_claimed(run_name: str) -> Iterator[None]:
    """While ``run_name`` runs: it is this process's one local-mode run (see :func:`claim_local_mode`)."""
    claim_local_mode(run_name)
    try:
        yield
    finally:
        release_local_mode()


def claim_local_mode(run_name: str) -> None:
    """Make ``run_name`` the one local-mode run of this process.

    Raises:
        ValueError: another local-mode fit runs in this process now (from another thread).
    """
    global _local_mode_run
    with _local_mode_lock:
        if _local_mode_run is not None:
            raise ValueError(
                f"Run {run_name!r}: local mode (ScalingConfig(num_workers=0)) runs the train function in this process, "
                f"and run {_local_mode_run!r} already does so from another thread; two at once would share one "
                "report()/get_context() session. Run them one after the other (Optuna: n_jobs=1), or give each "
                "worker processes (num_workers=1 or more)."
            )
        _local_mode_run = run_name


def release_local_mode() -> None:
    """The local-mode run of this process ended."""
    global _local_mode_run
    with _local_mode_lock:
        _local_mode_run = None
