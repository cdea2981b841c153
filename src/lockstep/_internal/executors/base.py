"""What every executor implements: an :class:`Executor`, how a run's ranks start and how the
run is driven from this process (its worker groups implement
:class:`lockstep._internal.run.worker_group.WorkerGroup`). What differs per executor and matters to
the run as a whole (the run's name, the scaling it runs with, what it holds while the run goes
on) is asked of the executor by ``fit()``; the driver and the controller never name one."""

from __future__ import annotations

import abc
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from lockstep._internal.run.run_names import default_run_name

if TYPE_CHECKING:
    from lockstep._internal.payload import TrainJob
    from lockstep._internal.run.driver import RunDriver
    from lockstep._internal.run.validation import ValidationLauncher
    from lockstep.config import ScalingConfig
    from lockstep.result import Result
    from lockstep.validation import ValidationConfig


class Executor(abc.ABC):
    """How a run's ranks start (local processes, Ray actors, or processes a launcher such as
    torchrun started) and how the run is driven from this process. ``fit()`` picks one with
    :func:`lockstep._internal.executors.choose_executor`, then calls :meth:`run_name` and
    :meth:`launch`."""

    #: The executor's name, as the run record keeps it.
    name: str

    def run_name(self, configured: str | None, trainer_name: str) -> str:
        """The run's name: ``RunConfig.name``, else a new default one."""
        return configured or default_run_name(trainer_name)

    def run_scaling(self, scaling: ScalingConfig) -> ScalingConfig:
        """The scaling the run records and is driven with (the trainer's, unless the executor
        runs another shape)."""
        return scaling

    def reserve(self, run_name: str) -> AbstractContextManager[None]:
        """What this executor holds in this process while run ``run_name`` goes on (nothing,
        unless it says otherwise).

        Raises:
            ValueError: the executor can't run it now (said before any rank starts).
        """
        return nullcontext()

    def validation_launcher(self, config: ValidationConfig, log_dir: str) -> ValidationLauncher:
        """Where this executor's run validates checkpoints: by default a fresh process on this
        machine per validation, its output in ``log_dir``.

        Raises:
            ValueError, TypeError: ``config`` can't be met here (said before any rank starts).
        """
        from lockstep._internal.executors.local_validation import ProcessValidationLauncher

        return ProcessValidationLauncher(config, log_dir)

    @abc.abstractmethod
    def launch(self, job: TrainJob, driver: RunDriver) -> Result:
        """Run ``job`` on every rank until the run ends, and return its Result.

        Raises:
            TrainingFailedError: the run failed.
            ValueError, TypeError: the job can't start (raised before any rank starts).
        """
