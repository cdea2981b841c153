"""Where a rank's time between two reports goes: waiting for data, waiting in collectives,
waiting in ``report()``, and the rest (compute).

Each rank keeps one :class:`StepClock`. The window of report N runs from the moment report N-1
was sent to the driver (the train function's start, for the first) to the moment report N is
sent, so the windows of a rank tile its time without gaps. Inside a window:

* **data**: time spent getting the next batch from the loader that ``prepare_data_loader``
  returned (the loader's iterator, including the copy to the device where lockstep makes it);
* **collective**: time blocked in ``lockstep.collective`` (barrier, broadcast) and, for a model
  that ``prepare_model`` wrapped in DDP on a gloo (CPU) process group, the tail of each backward
  pass: from the moment the last gradient bucket was handed to the all-reduce until all of the
  step's all-reduces were done (the time backward waits for the other ranks, plus the transfer
  itself; all-reduces that overlap with the backward computation are not counted). With NCCL the
  all-reduce waits on the GPU, not on the host, so it shows up as compute;
* **report**: time from sending report N-1 until every rank had made it (the report barrier).
  Saving a checkpoint inside ``report()`` is work, not waiting: it counts as compute;
* **compute**: the rest.

The counters are plain integers of ``time.perf_counter_ns()``: no lock and no system call per
batch. DDP's all-reduce callbacks run on the process group's thread, but DDP waits for them
before ``backward()`` returns, so they never race with reading the counters in ``report()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class StepTimes:
    """One rank's time in one report window, in seconds (travels with :class:`protocol.Report`).

    Attributes:
        window_s: The whole window: from the previous report being sent to this one.
        data_s: Waiting for batches.
        collective_s: Waiting in collectives (DDP gradient all-reduce on gloo, lockstep.collective).
        report_s: Waiting at the previous report's barrier for the other ranks.
    """

    window_s: float
    data_s: float
    collective_s: float
    report_s: float

    @property
    def compute_s(self) -> float:
        """The rest of the window."""
        return max(0.0, self.window_s - self.data_s - self.collective_s - self.report_s)


class StepClock:
    """A rank's counters for the current window (see the module's docstring)."""

    def __init__(self) -> None:
        self.data_ns = 0
        self.collective_ns = 0
        self.report_ns = 0
        self.window_start_ns = perf_counter_ns()

    def restart(self) -> None:
        """Start a fresh window now (the train function starts)."""
        self.data_ns = self.collective_ns = self.report_ns = 0
        self.window_start_ns = perf_counter_ns()

    def close_window(self) -> StepTimes:
        """The figures of the window that ends now; the next one starts."""
        now = perf_counter_ns()
        times = StepTimes(
            (now - self.window_start_ns) / 1e9, self.data_ns / 1e9, self.collective_ns / 1e9, self.report_ns / 1e9
        )
        self.data_ns = self.collective_ns = self.report_ns = 0
        self.window_start_ns = now
        return times


#: The clock of this process's rank (one rank per process).
CLOCK = StepClock()


def timed_batches(batches: Iterator[T], clock: StepClock = CLOCK) -> Iterator[T]:
    """``batches``, adding the time each ``next()`` takes to the clock's data wait."""
    clock_now = perf_counter_ns
    while True:
        started = clock_now()
        try:
            batch = next(batches)
        except StopIteration:
            clock.data_ns += clock_now() - started
            return
        clock.data_ns += clock_now() - started
        yield batch


class AllReduceTail:
    """The state of :func:`timed_allreduce_hook`: when the step's last bucket was launched."""

    def __init__(self, clock: StepClock = CLOCK) -> None:
        self.clock = clock
        self.mark_ns: int | None = None


def timed_allreduce_hook(state: AllReduceTail, bucket: Any) -> Any:
    """A DDP communication hook: the average of the bucket over the ranks (DDP's own default),
    timing the tail of the step's all-reduces into the collective wait."""
    import torch.distributed as dist

    if bucket.index() == 0:
        state.mark_ns = None
    if bucket.is_last():
        state.mark_ns = perf_counter_ns()
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size())
    future = dist.all_reduce(tensor, async_op=True).get_future()

    def reduced(done: Any) -> Any:
        if state.mark_ns is not None:
            now = perf_counter_ns()
            if now > state.mark_ns:
                state.clock.collective_ns += now - state.mark_ns
                state.mark_ns = now
        return done.value()[0]

    return future.then(reduced)


def with_all_reduce_timing(model: Any) -> Any:
    """``model`` (a DistributedDataParallel) timing its gradient all-reduce's wait, on gloo: a comm
    hook is registered at the first forward, unless the user registered one of their own by then
    (DDP takes one hook per model)."""
    import torch.distributed as dist

    if dist.get_backend(model.process_group) != "gloo":
        return model

    def register_once(module: Any, _: Any) -> None:
        handle.remove()
        if not module._comm_hooks and not module._get_ddp_logging_data().get("comm_hook"):
            module.register_comm_hook(AllReduceTail(), timed_allreduce_hook)

    handle = model.register_forward_pre_hook(register_once)
    return model


# DDP compares a hook's annotations with torch's types by value; postponed (string) annotations
# would fail that check, so the hook shows DDP none (its hints stay in the source).
timed_allreduce_hook.__annotations__ = {}
