"""A rank's progress, as the driver's hang detector sees it (see
:mod:`lockstep._internal.run.hang_watch`): counters the rank's own code moves, read now and
then by its progress thread (:mod:`lockstep._internal.rank.progress_sender`).

- ``work`` grows with every unit of work: a training step, a forward pass of a model that
  ``prepare_model`` returned (training or evaluation), a batch of a loader that
  ``prepare_data_loader`` returned, a ``report()`` or ``lockstep.collective`` call, the end of a
  stretch of lockstep's own long work. Each is one integer increment: nothing is sent per step.
- ``steps`` counts training steps: ``optimizer.step()`` calls of any torch optimizer (torch's
  global optimizer hook, installed once per process by :func:`count_optimizer_steps`), so a
  Lightning or Transformers loop counts as a plain one does; the last few step times give the
  median step time the hang threshold is measured in.
- :meth:`RankProgress.making_progress` marks lockstep's own long work (saving, staging or
  uploading a checkpoint; storage retries and validation can use it too) as progress for as
  long as it lasts: a rank inside it is never named hung, however long it takes.

Example (lockstep's own code, on a rank)::

    with PROGRESS.making_progress():
        copy_checkpoint_files()   # may take minutes on slow storage: not a hang
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter_ns
from typing import Any

__all__ = ["PROGRESS", "RankProgress", "count_forward", "count_forward_passes", "count_optimizer_steps", "count_work"]

#: How many recent step times the median is taken over.
STEP_TIMES_KEPT = 20


class RankProgress:
    """The progress counters of this process's rank (see the module's docstring).

    Args:
        clock: Nanoseconds, monotonic (``time.perf_counter_ns``; a test may pass its own).
    """

    def __init__(self, clock: Callable[[], int] = perf_counter_ns) -> None:
        self.clock = clock
        self.work = 0
        self.steps = 0
        self.train_thread: int | None = None
        self._busy = 0
        self._busy_lock = threading.Lock()
        self._step_ns: deque[int] = deque(maxlen=STEP_TIMES_KEPT)
        self._last_step_ns: int | None = None

    def restart(self) -> None:
        """Start counting afresh (a new train function starts on this thread)."""
        self.work = self.steps = 0
        self._step_ns.clear()
        self._last_step_ns = None
        self.train_thread = threading.get_ident()

    def mark(self, *_: Any) -> None:
        """One unit of work done (usable as a forward pre-hook)."""
        self.work += 1

    def step_done(self, *_: Any) -> None:
        """A training step ended (usable as torch's optimizer step post-hook)."""
        now = self.clock()
        if self._last_step_ns is not None:
            self._step_ns.append(now - self._last_step_ns)
        self._last_step_ns = now
        self.steps += 1
        self.work += 1

    @property
    def busy(self) -> bool:
        """Whether some of lockstep's own long work is going on now."""
        return self._busy > 0

    @contextmanager
    def making_progress(self) -> Iterator[None]:
        """Count the work inside the ``with`` block as progress however long it takes (from
        any thread; blocks may nest)."""
        with self._busy_lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy -= 1
            self.work += 1

    def median_step_s(self) -> float | None:
        """The median of the recent step times, in seconds (None before the second step)."""
        times = list(self._step_ns)
        return statistics.median(times) / 1e9 if times else None


#: The progress of this process's rank (one rank per process).
PROGRESS = RankProgress()

_optimizer_hook: Any = None


def count_forward(module: Any, inputs: Any) -> None:
    """A forward pre-hook: a forward pass of a prepared model is a unit of work (a module-level
    function, so that a model with the hook still pickles)."""
    PROGRESS.work += 1


def count_forward_passes(module: Any) -> None:
    """Count every forward pass of ``module`` (also when called directly, not through a wrapper
    around it) as a unit of work, once however often this is called for it."""
    if count_forward not in module._forward_pre_hooks.values():
        module.register_forward_pre_hook(count_forward)


def count_work() -> None:
    """One unit of work done (a step of a loop lockstep does not see, e.g. Lightning's)."""
    PROGRESS.work += 1


def count_optimizer_steps() -> None:
    """Count every ``optimizer.step()`` of this process as a training step (installed once)."""
    global _optimizer_hook
    if _optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _optimizer_hook = register_optimizer_step_post_hook(PROGRESS.step_done)
