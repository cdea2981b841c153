"""Validations on this machine (the local executor, local mode, torchrun): a fresh Python process
per validation (``python -m lockstep._internal.rank.validation_process``; never a fork of the
driver), in a session of its own, started by the driver's process.

Of ``ValidationConfig.ray_remote_kwargs``, the ones that mean something on one machine are
used: ``num_cpus`` (default 1, as a Ray task's: the process's thread count, counted with the
workers' CPUs), ``num_gpus`` (default 0: ``CUDA_VISIBLE_DEVICES`` names the GPUs it gets, none
by default, as Ray hides GPUs from a task that asks for none), ``memory`` (checked against the
machine), ``max_retries`` (default 3, as Ray's: a process that dies without an answer runs
again), ``retry_exceptions`` and ``name``. The others need a Ray cluster: they raise.

The job goes to the process pickled, in an in-memory file; the answer comes back as JSON on a
pipe (see :mod:`lockstep._internal.rank.validation_process`). Its output goes to
``validation_<checkpoint>.log`` in the run's ``logs/``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass, fields
from typing import Any

import cloudpickle

from lockstep._internal.payload import main_file, payload_in_memory
from lockstep._internal.rank.python_path import worker_pythonpath
from lockstep._internal.rank.rank_env import LAUNCHER_VARIABLES, threads_for
from lockstep._internal.rank.validation_process import ENV_ANSWER_FD, ENV_JOB_FD
from lockstep._internal.run.validation import RunningValidation, ValidationLauncher, ValidationOutcome, ValidationTask
from lockstep.validation import ValidationConfig

logger = logging.getLogger(__name__)

#: A rank's variables that a validation process must not inherit from a driver torchrun started.
RANK_VARIABLES = (*LAUNCHER_VARIABLES, "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE")
MAX_ANSWER_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class LocalOptions:
    """The ``ray.remote()`` options a validation process on this machine honours."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: float = 0.0
    max_retries: int = 3
    retry_exceptions: Any = False
    name: str | None = None


LOCAL_OPTIONS = tuple(option.name for option in fields(LocalOptions))


def local_options(ray_remote_kwargs: dict[str, Any]) -> LocalOptions:
    """The options of ``ray_remote_kwargs``, checked against this machine.

    Raises:
        ValueError: an option needs a Ray cluster, has a wrong value, or asks for more than
            this machine has.
    """
    unknown = sorted(set(ray_remote_kwargs) - set(LOCAL_OPTIONS))
    if unknown:
        raise ValueError(
            f"ValidationConfig(ray_remote_kwargs=...) has {unknown}, which only a Ray cluster can honour; on one "
            f"machine lockstep uses {', '.join(LOCAL_OPTIONS)}. Remove them, or run on Ray (ray.init(...) before "
            "fit())."
        )
    options = LocalOptions(**ray_remote_kwargs)
    for name in ("num_cpus", "num_gpus", "memory"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"ValidationConfig(ray_remote_kwargs={{'{name}': {value!r}}}): use a number >= 0.")
    if isinstance(options.max_retries, bool) or not isinstance(options.max_retries, int) or options.max_retries < -1:
        raise ValueError(
            f"ValidationConfig(ray_remote_kwargs={{'max_retries': {options.max_retries!r}}}): use an int >= 0, or -1 "
            "for no limit."
        )
    _check_fits_machine(options)
    return options


def _check_fits_machine(options: LocalOptions) -> None:
    cpus = os.cpu_count() or 1
    if options.num_cpus > cpus:
        raise ValueError(
            f"ValidationConfig(ray_remote_kwargs={{'num_cpus': {options.num_cpus:g}}}): this machine has {cpus} CPUs."
        )
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if options.memory > memory:
        raise ValueError(
            f"ValidationConfig(ray_remote_kwargs={{'memory': {options.memory:g}}}): this machine has {memory} bytes."
        )


class ProcessValidationLauncher(ValidationLauncher):
    """Starts each validation as a fresh process on this machine.

    Args:
        config: The trainer's validation config (its function is pickled here, once).
        log_dir: Where each validation's output goes.
        workers_cpus: The CPUs the run's workers ask for on this machine.
        workers_gpus: The GPUs the run's workers use (a validation asking for GPUs gets others
            when there are enough, else shares theirs).

    Raises:
        ValueError: the options can't be met on this machine.
        TypeError: the validation function can't be pickled.
    """

    def __init__(
        self, config: ValidationConfig, log_dir: str, workers_cpus: float = 0, workers_gpus: tuple[str, ...] = ()
    ) -> None:
        self.options = local_options(config.ray_remote_kwargs)
        self.log_dir = log_dir
        self.gpus = _validation_gpus(self.options.num_gpus, workers_gpus)
        try:
            self._fn = cloudpickle.dumps(config.fn)
        except Exception as error:
            raise TypeError(
                f"ValidationConfig(fn=...) can't be sent to the validation process: {type(error).__name__}: {error}. "
                "Create such objects (locks, open files, connections) inside the validation function instead."
            ) from error
        self._main_file = main_file()
        machine = os.cpu_count() or 1
        if workers_cpus + self.options.num_cpus > machine:
            logger.warning(
                "A validation (num_cpus=%g) and the workers (%g CPUs) ask for more CPUs than this machine's %d: while "
                "one runs, they share cores.",
                self.options.num_cpus,
                workers_cpus,
                machine,
            )

    def start(self, task: ValidationTask) -> RunningValidation:
        """Start a fresh process for ``task``."""
        job = cloudpickle.dumps(
            (self._fn, task.checkpoint, task.fn_kwargs, self.options.retry_exceptions, self._main_file)
        )
        os.makedirs(self.log_dir, exist_ok=True)
        log_path = os.path.join(self.log_dir, f"validation_{task.dir_name}.log")
        return ProcessValidation(job, self._environment(), log_path, self.options.max_retries)

    def _environment(self) -> dict[str, str]:
        env = {
            name: value
            for name, value in os.environ.items()
            if name not in RANK_VARIABLES and not name.startswith("TORCHELASTIC_")
        }
        threads = str(threads_for(self.options.num_cpus))
        env.update(
            PYTHONPATH=worker_pythonpath(env),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS=threads,
            MKL_NUM_THREADS=threads,
            LOCKSTEP_WARM_START="0",
            CUDA_VISIBLE_DEVICES=",".join(self.gpus),
        )
        return env


def _validation_gpus(num_gpus: float, workers_gpus: tuple[str, ...]) -> tuple[str, ...]:
    """The GPUs a validation asking for ``num_gpus`` gets: free ones first, then the workers'."""
    needed = math.ceil(num_gpus)
    if needed == 0:
        return ()
    from lockstep._internal.rank.devices import usable_gpu_ids

    usable = usable_gpu_ids()
    if needed > len(usable):
        raise ValueError(
            f"ValidationConfig(ray_remote_kwargs={{'num_gpus': {num_gpus:g}}}): this machine has {len(usable)} usable "
            "GPU(s)."
        )
    ordered = [gpu for gpu in usable if gpu not in workers_gpus] + [gpu for gpu in usable if gpu in workers_gpus]
    if needed > len(usable) - len(set(workers_gpus) & set(usable)):
        logger.info("The validation shares GPU(s) %s with the workers.", ",".join(ordered[:needed]))
    return tuple(ordered[:needed])


class ProcessValidation(RunningValidation):
    """One validation's process (and its tries, up to ``max_retries`` more)."""

    def __init__(self, job: bytes, env: dict[str, str], log_path: str, max_retries: int) -> None:
        self._job, self._env, self.log_path = job, env, log_path
        self._retries_left = max_retries
        self._outcome: ValidationOutcome | None = None
        self._start()

    def _start(self) -> None:
        job_fd = payload_in_memory(self._job)
        read_fd, write_fd = os.pipe()
        try:
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "lockstep._internal.rank.validation_process"],
                    env={**self._env, ENV_JOB_FD: str(job_fd), ENV_ANSWER_FD: str(write_fd)},
                    pass_fds=(job_fd, write_fd),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(job_fd)
            os.close(write_fd)
        os.set_blocking(read_fd, False)
        self._read_fd: int | None = read_fd
        self._pidfd: int | None = os.pidfd_open(self.process.pid)
        self._answer = bytearray()

    def wait(self, timeout: float | None) -> ValidationOutcome | None:
        """The outcome, once the process (and its retries) ended; None after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._outcome is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._wait_for_output(left)
            self._read_answer()
            if self._exited():
                self._collect()
            elif deadline is not None and time.monotonic() >= deadline:
                return None
        return self._outcome

    def cancel(self) -> None:
        """Kill the process and everything it started."""
        if self._pidfd is not None:
            self._kill_and_reap()
        if self._outcome is None:
            self._outcome = ValidationOutcome(error="stopped by the driver")

    # -- the process ------------------------------------------------------------------------

    def _wait_for_output(self, timeout: float | None) -> None:
        poller = select.poll()  # not select(): a descriptor may be numbered past 1024
        assert self._pidfd is not None
        poller.register(self._pidfd, select.POLLIN)
        if self._read_fd is not None:
            poller.register(self._read_fd, select.POLLIN)
        poller.poll(None if timeout is None else math.ceil(timeout * 1000))

    def _read_answer(self) -> None:
        while self._read_fd is not None:
            try:
                chunk = os.read(self._read_fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                os.close(self._read_fd)
                self._read_fd = None
                return
            self._answer += chunk
            if len(self._answer) > MAX_ANSWER_BYTES:
                self._kill_and_reap()
                self._outcome = ValidationOutcome(error=f"its metrics took more than {MAX_ANSWER_BYTES} bytes")
                return

    def _exited(self) -> bool:
        if self._pidfd is None:
            return True
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def _collect(self) -> None:
        """The process ended: take its answer, or try again when Ray's retry rules say so."""
        self._read_answer()  # what it wrote just before it ended
        self._kill_and_reap()  # also what it left running in its session
        reply = self._reply()
        if reply is not None and isinstance(reply.get("metrics"), dict):
            self._outcome = ValidationOutcome(metrics=reply["metrics"])
            return
        if reply is not None:
            error, retry = str(reply.get("error")), bool(reply.get("retry"))
        else:
            error = (
                f"the validation process ended with code {self.process.returncode} without an answer "
                f"(its output: {self.log_path})"
            )
            retry = True
        if retry and self._retries_left != 0:
            self._retries_left -= 1
            logger.warning("The validation failed (%s); trying again.", error.strip().splitlines()[-1])
            self._start()
            return
        self._outcome = ValidationOutcome(error=error)

    def _reply(self) -> dict[str, Any] | None:
        if not self._answer:
            return None
        try:
            reply = json.loads(bytes(self._answer))
        except ValueError:
            return {"error": "the validation process wrote an answer that is not JSON", "retry": False}
        return reply if isinstance(reply, dict) else None

    def _kill_and_reap(self) -> None:
        """SIGKILL the process's session while its leader is not reaped yet (so the group id
        can't have been reused), then reap it and close the handles."""
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        for handle in (self._pidfd, self._read_fd):
            if handle is not None:
                os.close(handle)
        self._pidfd = self._read_fd = None
