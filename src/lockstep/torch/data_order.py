"""Exact data order for the loaders that ``prepare_data_loader`` shards.

A :class:`ResumableDataLoader` is a ``DataLoader`` over a ``DistributedSampler`` that

* starts the sampler's next epoch by itself on each new pass (each ``iter(loader)``) after a
  pass that ran to its end, unless the caller chose the epoch with ``loader.sampler.set_epoch(e)``
  since the last pass (a pass left early, such as one rank's peek at a batch, is started over in
  its epoch: the ranks' epochs never drift apart by how often each one iterates), and
* remembers the epoch and how many batches of it were handed out, so that
  ``state_dict()`` / ``load_state_dict()`` let a restarted run continue the epoch where its
  checkpoint was taken: each sample once, in the order of an uninterrupted run.

The batches already seen are left out at the index level (the index iterator skips them), so
their samples are never loaded, and the data loader's worker processes (``num_workers > 0``)
see only the rest.

The time each ``next()`` on the loader's iterator takes is the rank's data wait
(:mod:`lockstep._internal.rank.step_timing`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any, cast

from torch.utils.data import DataLoader, DistributedSampler, Sampler

from lockstep._internal.rank.step_timing import timed_batches

__all__ = ["EpochTrackingSampler", "LoaderPosition", "ResumableDataLoader"]


logger = logging.getLogger(__name__)


class EpochTrackingSampler(DistributedSampler):
    """A ``DistributedSampler`` that notes each ``set_epoch`` call, so the loader can tell a
    caller's chosen epoch (even one equal to the last) from an epoch left unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch_chosen = False

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order for the next pass (as ``DistributedSampler.set_epoch``)."""
        super().set_epoch(epoch)
        self.epoch_chosen = True


class SkipFirst(Sampler):
    """The loader's index sampler (a batch sampler, or the sampler when unbatched) leaving out
    its first ``skip`` items. The loader sets ``skip`` before each pass (a DataLoader iterator
    may call ``iter`` on it more than once per pass, so it is not reset here)."""

    def __init__(self, index_sampler: Any) -> None:
        self.index_sampler = index_sampler
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.index_sampler), self.skip, None)

    def __len__(self) -> int:
        return len(self.index_sampler)


@dataclass(frozen=True)
class LoaderPosition:
    """Where a loader is: its epoch, the batches of it handed out, whether the pass ended, and
    the sharding those batches assume (world size and batch size)."""

    epoch: int
    batches_yielded: int
    pass_finished: bool
    num_replicas: int
    batch_size: int | None

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LoaderPosition:
        """Read a ``state_dict()``; ValueError when it is not one."""
        names = [field.name for field in fields(cls)]
        if not isinstance(state, dict) or any(name not in state for name in names):
            raise ValueError(
                f"load_state_dict: expected the dict that the prepared loader's state_dict() returns "
                f"(keys {names}), got {state!r}. Save loader.state_dict() in the checkpoint and pass it back."
            )
        return cls(**{name: state[name] for name in names})


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a ``DistributedSampler`` that moves to the next epoch by itself and
    can resume mid-epoch. Built by ``prepare_data_loader``; use it as any DataLoader.

    Example:
        >>> loader = prepare_data_loader(DataLoader(dataset, batch_size=32, shuffle=True))
        >>> if checkpoint: loader.load_state_dict(saved["loader"])
        >>> for epoch in range(start_epoch, epochs):
        ...     for batch in loader:  # epoch order without set_epoch; resumes mid-epoch
        ...         ...
        ...         report(metrics, checkpoint=...)  # with {"loader": loader.state_dict()} in it
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, DistributedSampler):
            raise ValueError(f"ResumableDataLoader needs a DistributedSampler, got {type(self.sampler).__name__}.")
        self._skipping = SkipFirst(super()._index_sampler)
        self._epoch = self.sampler.epoch  # the epoch of the current (or last) pass
        self._seen_epoch: int = self.sampler.epoch  # the sampler's epoch when this loader last set it
        self._passes = 0
        self._yielded = 0
        self._finished = False
        self._restored: LoaderPosition | None = None

    @property
    def _index_sampler(self) -> Any:
        # DataLoader's iterators read indices from here; a persistent-workers iterator keeps the
        # object it got first, so this is one object whose skip is set before each pass.
        skipping = self.__dict__.get("_skipping")
        return skipping if skipping is not None else super()._index_sampler

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator of batches, not DataLoader's iterator class
        epoch, skip = self._next_pass()
        self._start_pass(epoch, skip)
        return self._counted(timed_batches(super().__iter__()), self._passes)

    def _counted(self, batches: Iterator[Any], pass_number: int) -> Iterator[Any]:
        """``batches``, counting each one handed to the caller (a stale pass counts nothing)."""
        for batch in batches:
            if pass_number == self._passes:
                self._yielded += 1
            yield batch
        if pass_number == self._passes:
            self._finished = True

    def _start_pass(self, epoch: int, skip: int) -> None:
        self._set_epoch(epoch)
        self._skipping.skip = skip
        self._epoch, self._yielded, self._finished = epoch, skip, False
        self._passes += 1
        if skip:
            logger.info("prepared loader: resuming epoch %d after its first %d batches", epoch, skip)

    @property
    def _distributed(self) -> DistributedSampler[Any]:
        """The loader's sampler, a DistributedSampler (checked when the loader is made)."""
        return cast(DistributedSampler[Any], self.sampler)

    def _set_epoch(self, epoch: int) -> None:
        self._distributed.set_epoch(epoch)
        if isinstance(self.sampler, EpochTrackingSampler):
            self.sampler.epoch_chosen = False
        self._seen_epoch = epoch

    def _chosen_epoch(self) -> int | None:
        """The epoch the caller set on the sampler since this loader last did, else None."""
        sampler = self._distributed
        if getattr(sampler, "epoch_chosen", False) or sampler.epoch != self._seen_epoch:
            return sampler.epoch
        return None

    def _next_pass(self) -> tuple[int, int]:
        """(epoch, batches to skip) for the pass about to start."""
        chosen = self._chosen_epoch()
        restored, self._restored = self._restored, None
        if restored is not None:
            return _resumed_pass(restored, chosen)
        if chosen is not None or self._passes == 0:
            return self._distributed.epoch, 0
        if not self._finished:  # left before its end (a peek at a batch, a break): start its epoch over
            return self._epoch, 0
        return self._epoch + 1, 0

    def state_dict(self, held_back: int = 0) -> dict[str, Any]:
        """The epoch and the batches of it handed out so far, to save in a checkpoint.

        Args:
            held_back: Batches taken from this loader but not yet given to the caller (a
                wrapper that copies one batch ahead to the GPU passes 1).
        """
        if self._restored is not None:
            return asdict(self._restored)
        yielded = self._yielded - held_back
        return asdict(
            LoaderPosition(
                epoch=self._epoch,
                batches_yielded=yielded,
                pass_finished=self._finished and held_back == 0,
                num_replicas=self._distributed.num_replicas,
                batch_size=self.batch_size,
            )
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved ``state_dict()``: the next pass is the saved epoch from the batch
        after the last one handed out (or the following epoch, when the saved pass had ended)."""
        position = LoaderPosition.from_state(state)
        if (position.num_replicas, position.batch_size) != (self._distributed.num_replicas, self.batch_size):
            logger.warning(
                "prepared loader: the saved position is for %d workers and batch size %s, this run has %d "
                "and %s; epoch %d restarts from its first batch, so some samples are seen twice.",
                position.num_replicas,
                position.batch_size,
                self._distributed.num_replicas,
                self.batch_size,
                position.epoch,
            )
            position = LoaderPosition(
                epoch=position.epoch,
                batches_yielded=0,
                pass_finished=False,
                num_replicas=self._distributed.num_replicas,
                batch_size=self.batch_size,
            )
        self._restored = position
        self._seen_epoch = self._distributed.epoch
        if isinstance(self.sampler, EpochTrackingSampler):
            self.sampler.epoch_chosen = False


def _resumed_pass(saved: LoaderPosition, chosen: int | None) -> tuple[int, int]:
    """(epoch, skip) for the first pass after ``load_state_dict``; ``chosen`` is an epoch the
    caller set on the sampler after loading, if any."""
    if chosen is None:
        return (saved.epoch + 1, 0) if saved.pass_finished else (saved.epoch, saved.batches_yielded)
    if chosen == saved.epoch and not saved.pass_finished:
        return saved.epoch, saved.batches_yielded
    if chosen != saved.epoch and not saved.pass_finished:
        logger.warning(
            "prepared loader: the restored position is in epoch %d but sampler.set_epoch(%d) was called; "
            "starting epoch %d from its first batch.",
            saved.epoch,
            chosen,
            chosen,
        )
    return chosen, 0
