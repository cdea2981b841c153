"""A tap on the events of a run's worker groups: the driver hands what the ranks say to observers
(the run record's roster of ranks, the Prometheus exporter) on their way to the controller, so
the controller knows nothing of them.

An observer is a function of the list of events one ``wait_events()`` returned; it runs in the
controller's thread, before the controller handles them, and must be quick.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from lockstep._internal.run.run_record import RunRecorder
from lockstep._internal.run.worker_group import GroupFactory, WorkerGroup
from lockstep._internal.wire import protocol

#: Sees each batch of events of a worker group.
EventObserver = Callable[[Sequence[Any]], None]


class TappedGroup(WorkerGroup):
    """``group``, with every batch of its events shown to ``observers`` first."""

    def __init__(self, group: WorkerGroup, observers: Sequence[EventObserver]) -> None:
        self.group = group
        self.observers = list(observers)

    def start(self) -> None:
        self.group.start()

    def wait_events(self, timeout: float | None) -> list[Any]:
        events = self.group.wait_events(timeout)
        if events:
            for observe in self.observers:
                observe(events)
        return events

    def send(self, rank: int, message: Any) -> None:
        self.group.send(rank, message)

    def send_all(self, message: Any, ranks: range) -> None:
        self.group.send_all(message, ranks)

    def output_tail(self, rank: int) -> str:
        return self.group.output_tail(rank)

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        return self.group.dump_stacks(ranks)

    def return_value(self, finished: protocol.Finished) -> Any:
        return self.group.return_value(finished)

    def stop(self) -> None:
        self.group.stop()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)  # what an executor's own group offers beyond the interface


def tapped(make_group: GroupFactory, observers: Sequence[EventObserver]) -> GroupFactory:
    """``make_group``, starting groups whose events ``observers`` see (itself when there are none)."""
    if not observers:
        return make_group
    start_group = make_group.start_group
    return dataclasses.replace(make_group, start_group=lambda size: TappedGroup(start_group(size), observers))


def roster_of(recorder: RunRecorder) -> EventObserver:
    """An observer that notes in the run record where each rank runs, from its Hello."""

    def note_hellos(events: Sequence[Any]) -> None:
        for event in events:
            if isinstance(event, protocol.Hello):
                recorder.note_rank(event.rank, event.host, event.pid)

    return note_hellos
