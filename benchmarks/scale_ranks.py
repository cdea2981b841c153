"""Scripted ranks for ``scale_bench.py``: one process that plays many ranks, no torch.

Each rank opens the real worker-side channel (``connect_to_driver``: the same handshake and
credential check as a real rank) and speaks the real protocol messages; only the train function
is replaced by a script. The process reads its assignment as JSON on stdin (which ranks, each
with the environment a real rank would get and the descriptors of its stdout and stderr pipes),
then runs the script below for all its ranks, rank by rank within each step:

1. connect every rank and read its ``Start``, then wait until the benchmark says that every rank
   of the group is connected (as real ranks wait in ``init_process_group`` before their first step);
2. ``reports`` metrics-only reports (index 0 .. reports-1), ``interval_s`` apart (the "step");
   the process holding rank 0 times rank 0's report from send to answer;
3. one report with a checkpoint: each rank writes a small file into the checkpoint folder first;
4. ``output_s`` seconds of output: every rank writes ``lines_per_s`` numbered lines a second to
   its stdout pipe (each write timed: how long a rank is blocked on output);
5. a report (the output is done), the statistics written to ``stats_path``, a last report;
6. then every rank but the victim waits in one more report; the victim's process (it holds only
   the victim) waits to be killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from lockstep._internal.rank.step_timing import StepTimes
from lockstep._internal.wire import protocol
from lockstep._internal.wire.channel import WorkerChannel, connect_to_driver

PR_SET_PDEATHSIG = 1
CHECKPOINT_BYTES = 4096


class Rank:
    """One scripted rank: its channel and its stdout pipe."""

    def __init__(self, rank: int, env: dict[str, str], stdout_fd: int) -> None:
        self.rank = rank
        self.env = env
        self.stdout_fd = stdout_fd
        self.channel: WorkerChannel | None = None
        self.lines_written = 0

    def connect(self) -> None:
        self.channel = connect_to_driver(self.rank, self.env)
        start = self.channel.recv()
        assert isinstance(start, protocol.Start), start

    def send(self, message: Any) -> None:
        assert self.channel is not None
        self.channel.send(message)

    def answer(self) -> Any:
        assert self.channel is not None
        return self.channel.recv()


def report_all(ranks: list[Rank], answers: select.epoll, index: int, dir_name: str | None = None) -> float | None:
    """Every rank sends report ``index`` and waits for its answer; rank 0's round trip (s), if here."""
    times = StepTimes(window_s=0.05, data_s=0.01, collective_s=0.005, report_s=0.001)
    sent_at = {}
    for rank in ranks:
        message = protocol.Report(
            rank=rank.rank,
            index=index,
            metrics_json=json.dumps({"loss": 1.0 / (index + 1), "step": index}) if rank.rank == 0 else None,
            checkpoint_dir_name=dir_name,
            checkpoint_state="written" if dir_name else None,
            step_times=times,
        )
        sent_at[rank.rank] = time.perf_counter()
        rank.send(message)
    round_trip = None
    for rank in answered_in_turn(ranks, answers):
        done = rank.answer()
        assert isinstance(done, protocol.ReportDone) and done.index == index, done
        if rank.rank == 0:
            round_trip = time.perf_counter() - sent_at[0]
    return round_trip


def answered_in_turn(ranks: list[Rank], answers: select.epoll) -> Iterator[Rank]:
    """The ranks as their answers arrive (one process waits on all their channels at once, as
    ranks on many machines would each wait on their own). Each channel is registered with
    ``answers`` once, for one event at a time: it is armed again here, for this round's answer."""
    waiting = {}
    for rank in ranks:
        fd = rank.channel.fileno()  # type: ignore[union-attr]
        answers.modify(fd, select.EPOLLIN | select.EPOLLONESHOT)
        waiting[fd] = rank
    while waiting:
        for fd, _ in answers.poll():
            rank = waiting.pop(fd, None)
            if rank is not None:
                yield rank


def write_checkpoint_files(ranks: list[Rank], run_path: str, dir_name: str) -> None:
    folder = os.path.join(run_path, dir_name)
    for rank in ranks:
        rank.send(protocol.WritingCheckpoint(rank.rank, dir_name))
    os.makedirs(folder, exist_ok=True)
    payload = os.urandom(CHECKPOINT_BYTES)
    for rank in ranks:
        with open(os.path.join(folder, f"rank_{rank.rank}.bin"), "wb") as handle:
            handle.write(payload)


def write_output(ranks: list[Rank], seconds: float, lines_per_s: float) -> float:
    """Every rank writes numbered lines at ``lines_per_s`` for ``seconds``; the longest write (s)."""
    longest = 0.0
    tick = 1.0 / lines_per_s
    started = time.monotonic()
    ticks = int(seconds * lines_per_s)
    for number in range(ticks):
        for rank in ranks:
            line = f"rank {rank.rank} line {number} " + "x" * 40 + "\n"
            before = time.perf_counter()
            os.write(rank.stdout_fd, line.encode())
            longest = max(longest, time.perf_counter() - before)
            rank.lines_written += 1
        pause = started + (number + 1) * tick - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    return longest


def main() -> None:
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    spec = json.loads(sys.stdin.readline())
    ranks = [Rank(item["rank"], item["env"], item["stdout_fd"]) for item in spec["ranks"]]
    answers = select.epoll()
    for rank in ranks:
        rank.connect()
        answers.register(rank.channel.fileno(), select.EPOLLONESHOT)  # type: ignore[union-attr]  # armed per round
    if sys.stdin.readline() != "go\n":  # every rank is connected (a real rank waits in init_process_group)
        raise SystemExit("scale_ranks: the benchmark ended before every rank connected")
    stats: dict[str, Any] = {"ranks": [rank.rank for rank in ranks], "round_trips_s": []}
    index = 0
    for _ in range(spec["reports"]):
        time.sleep(spec["interval_s"])
        round_trip = report_all(ranks, answers, index)
        if round_trip is not None:
            stats["round_trips_s"].append(round_trip)
        index += 1
    dir_name = "checkpoint_scale"
    write_checkpoint_files(ranks, spec["run_path"], dir_name)
    stats["checkpoint_report_sent_at"] = time.time()
    report_all(ranks, answers, index, dir_name)
    index += 1
    stats["longest_output_write_s"] = write_output(ranks, spec["output_s"], spec["lines_per_s"])
    stats["lines_written"] = {str(rank.rank): rank.lines_written for rank in ranks}
    report_all(ranks, answers, index)
    index += 1
    with open(spec["stats_path"], "w") as handle:
        json.dump(stats, handle)
    report_all(ranks, answers, index)
    index += 1
    if spec["victim"]:
        while True:  # killed by the benchmark
            time.sleep(60)
    for rank in ranks:
        rank.send(protocol.Report(rank=rank.rank, index=index, metrics_json=None))
    for rank in ranks:
        with contextlib.suppress(EOFError, OSError):
            rank.answer()
    while True:  # the driver stops the group once the victim is named
        time.sleep(60)


if __name__ == "__main__":
    main()
