"""The driver: what the process that drives a run does, whichever executor starts its ranks.
It checks the storage, opens the run record, builds the run's listeners and the controller,
and runs the controller to a Result. While it drives the run on the main thread, SIGTERM is a
preemption notice and SIGHUP ends the run as interrupted (see
:mod:`lockstep._internal.run.preemption`): either way the run record ends in a final status.

Several fits may run at once from threads of one process (an Optuna study with ``n_jobs=2``):
each has its own driver, workers, record and listeners. Signal handlers are only installed by a
fit driven on the main thread. The driver never asks which executor runs: what differs per
executor (local mode's claim of the process, the local workers' CPUs, the scaling the run
records) ``fit()`` asks of the executor (:class:`lockstep._internal.executors.base.Executor`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lockstep._internal.output.listeners import listeners_for
from lockstep._internal.output.metrics_export import MetricsExporter, start_exporter
from lockstep._internal.output.worker_output import ConsoleMode
from lockstep._internal.persist.storage import RunStorage, check_storage_path, storage_errors
from lockstep._internal.run.controller import Controller
from lockstep._internal.run.group_tap import roster_of, tapped
from lockstep._internal.run.hang_watch import HangRule
from lockstep._internal.run.preemption import Preemption, driver_signals
from lockstep._internal.run.run_record import RunRecorder
from lockstep._internal.run.upkeep import RunUpkeep
from lockstep._internal.run.validation import ValidationSetup
from lockstep._internal.run.worker_group import GroupFactory
from lockstep.callbacks import RunInfo, TrainRunContext
from lockstep.config import DEFAULT_STORAGE_PATH, RunConfig, ScalingConfig
from lockstep.result import Result

logger = logging.getLogger(__name__)


class RunDriver:
    """Drives the run kept in ``storage``.

    Args:
        storage: The run folder.
        run_config: The run's settings (failures, checkpoints, callbacks, output).
        scaling: The run's workers (as the executor runs them: see ``Executor.run_scaling``).
        has_resume_checkpoint: Whether the trainer got a ``resume_from_checkpoint`` (the ranks
            start from it while the run has no checkpoint of its own).
        config: The run's configuration as its record keeps it (see
            :mod:`lockstep._internal.run.config_record`).
        run_context: What Ray's UserCallbacks get as ``run_context``.
        validation: The trainer's validation function and the executor's launcher, if the
            trainer has a ``validation_config``.
    """

    def __init__(
        self,
        storage: RunStorage,
        run_config: RunConfig,
        scaling: ScalingConfig,
        has_resume_checkpoint: bool,
        config: dict[str, Any] | None = None,
        run_context: TrainRunContext | None = None,
        validation: ValidationSetup | None = None,
    ) -> None:
        self.storage = storage
        self.run_config = run_config
        self.scaling = scaling
        self.has_resume_checkpoint = has_resume_checkpoint
        self.config = config
        self.run_context = run_context
        self.validation = validation
        self.log_dir = storage.local_log_dir()
        self.console: ConsoleMode = run_config.worker_output
        self._drove = False

    def prepare(self, make_group: GroupFactory, restarts: bool = True, watch_hangs: bool = True) -> Controller:
        """Check the storage, open the run record, and build the controller that will start
        groups with ``make_group`` (restarting after failures only when ``restarts``; with the
        hang detector of ``FailureConfig`` unless not ``watch_hangs``).

        Raises:
            ValueError: the storage can't hold the run, or the run can't be continued.
        """
        storage_path = os.fspath(self.run_config.storage_path or DEFAULT_STORAGE_PATH)
        preemption = Preemption(self.run_config.failure_config.preemption_grace_s)
        exporter = start_exporter(self.run_config, self.storage.name, lambda: preemption.notices)
        try:
            recorder = self._open_record(storage_path, make_group.executor, exporter)
        except BaseException:
            if exporter is not None:
                exporter.release()
            raise
        logger.info(
            "Run %s: %s workers (%s executor), results in %s",
            self.storage.name,
            self.scaling.num_workers,
            make_group.executor,
            self.storage.display_path,
        )
        run_info = RunInfo(self.storage.name, self.storage.display_path, self.scaling.max_workers, self.log_dir)
        failure_config = self.run_config.failure_config
        observers = [roster_of(recorder), *([exporter.observe] if exporter is not None else [])]
        return Controller(
            make_group=tapped(make_group, observers),
            recorder=recorder,
            max_failures=failure_config.max_failures if restarts else 0,
            has_resume_checkpoint=self.has_resume_checkpoint,
            report_timeout_s=failure_config.report_timeout_s,
            listeners=listeners_for(
                self.run_config, run_info, [exporter] if exporter is not None else [], self.run_context
            ),
            preemption=preemption,
            hang_rule=HangRule.from_config(failure_config) if watch_hangs else None,
            validation=self.validation,
        )

    def _open_record(self, storage_path: str, executor: str, exporter: MetricsExporter | None) -> RunRecorder:
        """Check the storage, and open the run record (marked running, with its config and metrics URL)."""
        with storage_errors(storage_path):
            check_storage_path(storage_path, self.storage)
            recorder = RunRecorder(self.storage, self.run_config.checkpoint_config, self.scaling.max_workers, executor)
            recorder.check_resumable()
            if recorder.earlier_record is not None:  # a rerun appends to the run's logs, on any storage
                self.storage.take_in_earlier_logs(self.log_dir, recorder.earlier_record.get("driver"))
            recorder.open({"config": self.config, "metrics_url": exporter.url if exporter is not None else None})
        return recorder

    def drive(self, controller: Controller) -> Result:
        """Run ``controller`` to the end of the run, its record beating and (on remote storage) its
        logs copied to storage as it goes (see :mod:`lockstep._internal.run.upkeep`); the logs go
        to storage at the end either way."""
        self._drove = True
        try:
            with (
                driver_signals(controller.preemption, lambda: list(range(controller.recorder.world_size))),
                RunUpkeep(controller.recorder, self.log_dir),
            ):
                return controller.run()
        finally:
            self._keep_logs()

    def discard_unused_logs(self) -> None:
        """Remove the local folder for the workers' logs (remote storage) if no run was driven: the
        fit ended before its first attempt (a refused storage, a job that can't be serialized)."""
        if not self._drove:
            self.storage.discard_local_logs(self.log_dir)

    def _keep_logs(self) -> None:
        """Copy the logs to remote storage; when that fails, say where they stay instead of
        replacing the run's outcome (its result, or the error it raised) with the copy's error."""
        try:
            self.storage.upload_logs(self.log_dir)
        except OSError as error:
            logger.warning(
                "The workers' logs could not be copied to %s (%s); they stay in %s.",
                self.storage.display_path,
                error,
                self.log_dir,
            )

    def run(self, make_group: GroupFactory, restarts: bool = True) -> Result:
        """:meth:`prepare`, then :meth:`drive`."""
        return self.drive(self.prepare(make_group, restarts))
