"""Where a rank's time between two reports goes: waiting for data, waiting in collectives,
waiting in ``report()``, and the rest (compute).

Each rank keeps one :class:`StepClock`. The window of report N runs from the moment report N-1
was sent to the driver (the train function's start, for the first) to the moment report N is
sent, so the windows of a rank tile its time without gaps. Inside a window:

* **data**: time spent getting the next batch from the loader that ``prepare_data_loader``
  returned (the loader's iterator, including the copy to the device where lockstep makes it);
* **collective**: time blocked in ``lockstep.collective`` (barrier, broadcast) and, for a model
  that ``prepare_model`` wrapped in DDP on a gloo (CPU) process group, the tail of each backward
  pass: the part of the step's all-reduces that did not overlap with the backward computation
  (the time backward waits for the other ranks, plus the last transfer), as DDP's own runtime
  statistics sample it (:class:`AllReduceWait`). With NCCL the all-reduce waits on the GPU, not
  on the host, so it shows up as compute;
* **report**: time from sending report N-1 until every rank had made it (the report barrier).
  Saving a checkpoint inside ``report()`` is work, not waiting: it counts as compute;
* **compute**: the rest.

The counters are plain integers of ``time.perf_counter_ns()``: no lock and no system call per
batch; DDP's figures are read once per report.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, TypeVar

from lockstep._internal.rank.progress import PROGRESS

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
        self.all_reduce_waits: list[AllReduceWait] = []

    def restart(self) -> None:
        """Start a fresh window now (the train function starts)."""
        self.data_ns = self.collective_ns = self.report_ns = 0
        self.window_start_ns = perf_counter_ns()
        self.all_reduce_waits = []

    def close_window(self) -> StepTimes:
        """The figures of the window that ends now; the next one starts."""
        now = perf_counter_ns()
        self.collective_ns += sum(wait.take_ns() for wait in self.all_reduce_waits)
        times = StepTimes(
            (now - self.window_start_ns) / 1e9, self.data_ns / 1e9, self.collective_ns / 1e9, self.report_ns / 1e9
        )
        self.data_ns = self.collective_ns = self.report_ns = 0
        self.window_start_ns = now
        return times


#: The clock of this process's rank (one rank per process).
CLOCK = StepClock()


def timed_batches(batches: Iterator[T], clock: StepClock = CLOCK) -> Iterator[T]:
    """``batches``, adding the time each ``next()`` takes to the clock's data wait (and each
    batch to the rank's progress)."""
    clock_now = perf_counter_ns
    progress = PROGRESS
    while True:
        started = clock_now()
        try:
            batch = next(batches)
        except StopIteration:
            clock.data_ns += clock_now() - started
            return
        clock.data_ns += clock_now() - started
        progress.work += 1
        yield batch


class AllReduceWait:
    """The gradient all-reduce's wait of one DDP model, from DDP's own runtime statistics.

    DDP times its backward pass in C++ on the steps it samples (the first ten, then every
    hundredth): how long the all-reduces ran, and how long of that overlapped the backward
    computation. The rest, the tail, is the time backward waited for the other ranks (plus
    the last transfer). A window counts the latest sampled tail once per training step it saw
    (steps are counted by a forward pre-hook, with gradients on): an estimate that costs
    nothing per step, where timing every step with a Python comm hook cost about 1 % of a
    small model's step.

    Args:
        model: A DistributedDataParallel.
    """

    def __init__(self, model: Any) -> None:
        self.model = weakref.ref(model)
        self.steps = 0
        model.register_forward_pre_hook(self.count_step)

    def count_step(self, module: Any, inputs: Any) -> None:
        """A forward pass began: a training step when gradients are on."""
        if torch_grad_enabled():
            self.steps += 1

    def take_ns(self) -> int:
        """The estimated wait of the steps since the last call."""
        steps, self.steps = self.steps, 0
        model = self.model()
        if model is None or not steps:
            return 0
        figures = model._get_ddp_logging_data()
        ran, overlapped = figures.get("backward_comm_time"), figures.get("backward_compute_comm_overlap_time")
        if ran is None or overlapped is None:
            return 0
        return max(0, int(ran) - int(overlapped)) * steps


def torch_grad_enabled() -> bool:
    """Whether autograd records now (a forward pass without it, e.g. under ``torch.no_grad()``
    for validation, is no training step)."""
    import torch

    return torch.is_grad_enabled()


def with_all_reduce_timing(model: Any, clock: StepClock = CLOCK) -> Any:
    """``model`` (a DistributedDataParallel) with its gradient all-reduce's wait counted into
    ``clock``'s collective time, on gloo (see :class:`AllReduceWait`; on NCCL the wait is on
    the GPU and shows as compute). The model is DDP's own, with no hook of lockstep's: a comm
    hook of the user's registers as usual."""
    import torch.distributed as dist

    if dist.get_backend(model.process_group) == "gloo":
        clock.all_reduce_waits.append(AllReduceWait(model))
    return model
