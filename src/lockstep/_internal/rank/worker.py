"""The worker runtime, and the worker process: ``python -m lockstep._internal.rank.worker``.

A rank connects back to the driver, loads its job, learns where the attempt starts, joins the
process group, runs the train function under a
:class:`~lockstep._internal.rank.worker_session.WorkerSession`, reports the outcome and exits. It dies
with the driver: if the driver is killed, the kernel kills this process too.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import inspect
import logging
import mmap
import os
import signal
import sys
import traceback
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lockstep._internal.rank.rank_env import ENV_DRIVER_ADDRESS, RankEnv

if TYPE_CHECKING:
    from lockstep._internal.payload import TrainJob
    from lockstep._internal.wire.channel import WorkerChannel
    from lockstep._internal.wire.protocol import Start
    from lockstep.checkpoint import Checkpoint

ENV_PAYLOAD_FD = "LOCKSTEP_PAYLOAD_FD"
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), and exit now if it
    already has. The parent is the driver, or ``parent_pid`` (the warm process that forked it,
    which dies with the driver)."""
    from lockstep._internal.wire.channel import ENV_DRIVER_PID

    driver_pid = os.environ.get(ENV_DRIVER_PID)
    if driver_pid is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != (parent_pid or int(driver_pid)):
        os._exit(1)


def answer_stack_requests() -> None:
    """On SIGUSR1, write every thread's Python stack into the in-memory file the driver reads
    (:mod:`lockstep._internal.rank.stack_buffer`; used to show where each rank was when the run
    failed or hung)."""
    from lockstep._internal.rank.stack_buffer import ENV_STACK_FD

    fd = os.environ.get(ENV_STACK_FD)
    if fd:
        global _stack_file
        os.set_inheritable(int(fd), False)  # the rank's own subprocesses have no use for it
        _stack_file = os.fdopen(int(fd), "w")  # must stay open for the signal handler
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)


_stack_file: Any = None


def main(forked_by: int | None = None) -> None:
    """Run one rank of the job and exit. ``forked_by``: the warm process this rank was forked
    from (see :mod:`lockstep._internal.warm.zygote`), None when the driver started it."""
    die_with_parent(forked_by)
    answer_stack_requests()
    from lockstep._internal.rank.forwarded_output import ENV_FORWARD_OUTPUT, ForwardedOutput
    from lockstep._internal.run.preemption import rank_signals
    from lockstep._internal.wire.channel import connect_to_driver
    from lockstep._internal.wire.link_watch import DriverWatch

    rank_env = RankEnv.from_environ()
    channel = connect_to_driver(rank_env.world_rank)
    watch = DriverWatch(channel.fileno(), rank_env.world_rank, os.environ[ENV_DRIVER_ADDRESS])
    output: Any = contextlib.nullcontext()
    if os.environ.get(ENV_FORWARD_OUTPUT) == "1":  # forked on a Ray node: the driver can't read our pipes
        output = ForwardedOutput(channel, rank_env.world_rank)
    with rank_signals(channel, rank_env.world_rank), watch, output:  # SIGTERM: a preemption notice, not the end
        outcome, exit_code = run_to_outcome(
            rank_env, channel, lambda: _job_from(_read_payload(int(os.environ[ENV_PAYLOAD_FD])))
        )
    _send_and_exit(channel, outcome, exit_code)


def _job_from(buffer: Any) -> TrainJob:
    from lockstep._internal.payload import deserialize_payload

    return deserialize_payload(buffer)


def run_to_outcome(
    rank_env: RankEnv,
    channel: WorkerChannel,
    load_job: Callable[[], TrainJob],
    extra_datasets: dict[str, Any] | None = None,
    keep_return_value: Callable[[Any], None] | None = None,
) -> tuple[Any, int]:
    """Run the rank and say how it ended: a Finished or Failed message, and an exit code.

    Rank 0's return value travels pickled in its Finished message, unless ``keep_return_value``
    takes it (when the driver is this very process, nothing needs to be pickled).
    """
    from lockstep._internal.wire import protocol

    rank = rank_env.world_rank
    try:
        value = run_rank(rank_env, channel, load_job, extra_datasets)
        if rank != 0:
            return protocol.Finished(rank, None), 0
        if keep_return_value is not None:
            keep_return_value(value)
            return protocol.Finished(rank, None), 0
        return protocol.Finished(rank, _pickled_return_value(value)), 0
    except BaseException as error:  # noqa: BLE001 - every failure must reach the driver
        return protocol.Failed(describe_failure(rank, error)), 1


def run_rank(
    rank_env: RankEnv,
    channel: WorkerChannel,
    load_job: Callable[[], TrainJob],
    extra_datasets: dict[str, Any] | None = None,
) -> Any:
    """Load the job, learn where this attempt starts, run the train function, and return
    what it returned.

    ``extra_datasets`` are shards the executor made for this rank (Ray Data's streaming splits).
    """
    import torch

    from lockstep._internal.rank.progress_sender import progress_reported
    from lockstep._internal.rank.session_state import set_session
    from lockstep._internal.rank.storage_outages import ride_out_outages
    from lockstep._internal.rank.train_context import TrainContext
    from lockstep._internal.rank.worker_session import WorkerSession
    from lockstep._internal.wire import protocol
    from lockstep.data import RayDataShard, shard_datasets

    torch.set_num_threads(rank_env.threads)
    job = load_job()
    restore_source_file(job.train_fn, job.main_file)
    start = channel.recv()
    if not isinstance(start, protocol.Start):
        raise RuntimeError(f"the driver sent {type(start).__name__} where a Start was due (a lockstep bug)")
    context = TrainContext(
        world_rank=rank_env.world_rank,
        world_size=rank_env.world_size,
        local_rank=rank_env.local_rank,
        local_world_size=rank_env.local_world_size,
        node_rank=rank_env.node_rank,
        experiment_name=job.storage.name,
        storage=job.storage,
        metadata=job.metadata,
        gpu_ids=rank_env.gpu_ids,
    )
    ride_out_outages(context.storage, channel, context.world_rank)  # resume reads included
    datasets = shard_datasets(job.datasets, context.world_rank, context.world_size, job.dataset_config.should_split)
    datasets.update({name: RayDataShard(shard) for name, shard in (extra_datasets or {}).items()})
    session = WorkerSession(
        context=context,
        channel=channel,
        first_report_index=start.first_report_index,
        checkpoint=starting_checkpoint(start, job),
        datasets=datasets,
        used_dir_names=start.used_dir_names,
        has_validation=job.has_validation,
        every_rank_metrics=job.every_rank_metrics,
    )
    set_session(session)
    os.environ.update(rank_env.socket_variables())  # on the rank's own host: its interfaces
    with progress_reported(channel, context.world_rank, start.progress_every_s, session.calls):
        job.backend_config.on_worker_start(context, job.use_gpu)
        try:
            value = call_train_fn(job.train_fn, job.train_loop_config)
            session.wait_for_uploads()
        finally:
            job.backend_config.on_worker_shutdown()
    return value


def starting_checkpoint(start: Start, job: TrainJob) -> Checkpoint | None:
    """The checkpoint ``get_checkpoint()`` returns at the start of this attempt."""
    if start.checkpoint is not None:
        return job.storage.checkpoint_of(start.checkpoint)
    return job.resume_checkpoint if start.from_resume_checkpoint else None


def _read_payload(inherited_fd: int) -> mmap.mmap:
    """Map the driver's in-memory payload file copy-on-write (through a fresh file description,
    so ranks share no offset) and let go of the descriptor: the map keeps the memory alive, and
    the payload's tensors are used from it without a copy."""
    with open(f"/proc/self/fd/{inherited_fd}", "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    os.close(inherited_fd)
    return mapped


def restore_source_file(train_fn: Callable[..., Any], main_file: str | None) -> None:
    """Give the functions of the user's script their file name back, which cloudpickle replaces
    with ``<dynamic-code>``, so tracebacks show the script's path and source lines."""
    if main_file is None:
        return
    seen: set[int] = set()
    candidates = [train_fn, *getattr(train_fn, "__globals__", {}).values()]
    for candidate in candidates:
        functions = [candidate] if inspect.isfunction(candidate) else []
        if inspect.isclass(candidate):
            functions = [member for member in vars(candidate).values() if inspect.isfunction(member)]
        for function in functions:
            if id(function) not in seen and function.__code__.co_filename == "<dynamic-code>":
                seen.add(id(function))
                function.__code__ = _with_filename(function.__code__, main_file)


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    constants = tuple(
        _with_filename(constant, filename) if isinstance(constant, types.CodeType) else constant
        for constant in code.co_consts
    )
    return code.replace(co_filename=filename, co_consts=constants)


def call_train_fn(train_fn: Callable[..., Any], config: dict[str, Any] | None) -> Any:
    """Call the train function with the config when it takes an argument."""
    takes_config = len(inspect.signature(train_fn).parameters) > 0
    return train_fn(config if config is not None else {}) if takes_config else train_fn()


def _pickled_return_value(value: Any) -> bytes | None:
    if value is None:
        return None
    import cloudpickle

    try:
        return cloudpickle.dumps(value)
    except Exception as error:
        raise TypeError(
            f"rank 0's train function returned a {type(value).__name__} that can't be pickled ({error}); "
            "return plain data (numbers, dicts, CPU tensors)."
        ) from error


def describe_failure(rank: int, error: BaseException) -> Any:
    """The failure as the driver shows it: the error and the traceback below lockstep's frames."""
    from lockstep.errors import WorkerFailure

    frames = error.__traceback__
    while frames is not None and frames.tb_frame.f_code.co_filename == __file__:
        frames = frames.tb_next
    frames = frames or error.__traceback__
    text = "".join(traceback.format_exception(type(error), error, frames))
    return WorkerFailure(rank=rank, error_type=type(error).__name__, message=str(error), traceback=text)


def _send_and_exit(channel: WorkerChannel, outcome: Any, exit_code: int) -> None:
    """Tell the driver how this rank ended, then exit at once (no lingering threads)."""
    try:
        channel.send(outcome)
    except OSError:
        exit_code = exit_code or 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    main()
