"""Many ranks through one driver: the real driver with scripted ranks, at 64, 256 and 1,024 ranks.

What runs is lockstep's own driver (``RunDriver``: the controller, the channels with their
authentication, the run record on local storage, the listeners with the progress line, and the
relay of the ranks' output into their log files). Only the ranks are scripted
(``scale_ranks.py``): many ranks per process, each with the real worker-side channel code over
a real TCP socket and real stdout/stderr pipes, no torch. Ranks ``0 .. N-2`` are played by
processes of ``--ranks-per-process`` ranks; rank ``N-1`` by a process of its own (the victim of
the lost-rank case).

Each size runs as a fresh driver process (so its peak RSS is its own), sizes interleaved round
by round. Per size and round it measures:

* ``connect_s``: from the call that starts the run until every rank has connected (the last
  Hello handled);
* ``report_p50_ms`` / ``report_p99_ms``: rank 0's metrics-only ``report()`` round trip, from its
  send to the driver's answer, over ``--reports`` reports ``--interval-ms`` apart, every rank
  reporting;
* ``commit_s``: a checkpoint every rank wrote a small file into, from the last rank's report
  being sent to the listener hearing that the record names it;
* ``driver_cpu_ms_per_report``: the driver process's CPU time (every thread) over the metrics-only
  reports, per report round;
* ``driver_rss_mib``: the driver's peak RSS;
* ``output_lines_lost``: every rank writes 20 numbered lines a second for ``--output-s`` seconds;
  the lines missing from the rank logs afterwards (and ``output_block_ms``: the longest a rank's
  write to its pipe blocked);
* ``lost_rank_named_s``: the victim's process is killed with SIGKILL; until the run fails with
  an error that names its rank.

Goals (fixed before measuring; the issue's, at 1,024 ranks): connect <= 5 s, report p50 <= 20 ms
and p99 <= 50 ms, commit <= 2 s, driver CPU <= 20 ms per report round, driver RSS <= 1 GiB, no
output line lost and no rank blocked on output more than 100 ms, the lost rank named within 2 s;
from 64 to 1,024 ranks the driver CPU per report grows at most linearly (ratio <= 16). Each is
judged on the median over rounds of the per-round figure, by its 95 % bootstrap interval's far end
(``record.Goal``), for the largest size measured.

    python benchmarks/scale_bench.py --ranks 64 256 1024 --rounds 5 --results-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe_machine, machine_line  # noqa: E402
from record import Goal, add_results_args, bootstrap_ci, goals_markdown, write_result  # noqa: E402

HERE = Path(__file__).resolve().parent
RANKS_SCRIPT = HERE / "scale_ranks.py"
SIZE_TIMEOUT_S = 600


# -- one size, in a fresh driver process --------------------------------------------------------


def _scripted_group_class() -> Any:
    """The worker group of scripted ranks: :class:`ScriptedRanks` on lockstep's ``ChannelGroup``
    (put together here so that the parent never imports lockstep)."""
    from lockstep._internal.executors.channels import ChannelGroup
    from lockstep._internal.run.worker_group import WorkerExited

    class ScriptedGroup(ScriptedRanks, ChannelGroup):
        worker_exited = WorkerExited

    return ScriptedGroup


class ScriptedRanks:
    """``world_size`` scripted ranks in processes of ``per_process`` (the last rank alone): the
    methods of the group that :func:`_scripted_group_class` mixes into lockstep's ``ChannelGroup``
    (whose ``_channels``, ``_output``, ``_wait`` and ``_close_channels`` they use)."""

    worker_exited: Any  #: lockstep's ``WorkerExited``, set by :func:`_scripted_group_class`

    def __init__(self, world_size: int, log_dir: str, script: dict[str, Any], per_process: int) -> None:
        super().__init__("127.0.0.1", world_size, log_dir, "none")
        self.world_size = world_size
        self.script = script
        self.layout = _layout(world_size, per_process)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.exit_handles: dict[int, int] = {}  # pidfd -> process index
        self.released = False

    def start(self) -> None:
        for number, ranks in enumerate(self.layout):
            self.processes.append(self._start_process(number, ranks))
            handle = os.pidfd_open(self.processes[-1].pid)
            self.exit_handles[handle] = number
            self._channels.watch(handle, tag=handle)

    def _start_process(self, number: int, ranks: list[int]) -> subprocess.Popen[bytes]:
        pipes = {rank: (os.pipe(), os.pipe()) for rank in ranks}
        spec = {
            **self.script,
            "victim": number == len(self.layout) - 1,
            "stats_path": os.path.join(self.script["stats_dir"], f"process_{number}.json"),
            "ranks": [
                {"rank": rank, "env": self._channels.worker_env(rank), "stdout_fd": out[1], "stderr_fd": err[1]}
                for rank, (out, err) in pipes.items()
            ],
        }
        write_ends = [end for out, err in pipes.values() for end in (out[1], err[1])]
        process = subprocess.Popen(
            [sys.executable, str(RANKS_SCRIPT)], stdin=subprocess.PIPE, pass_fds=write_ends, start_new_session=True
        )
        for end in write_ends:
            os.close(end)
        for rank, (out, err) in pipes.items():
            assert self._output is not None
            self._output.attach(rank, os.fdopen(out[0], "rb", buffering=0), os.fdopen(err[0], "rb", buffering=0))
        assert process.stdin is not None
        process.stdin.write(json.dumps(spec).encode() + b"\n")
        process.stdin.flush()
        return process

    def _release_when_all_connected(self) -> None:
        """Let every process start its reports once every rank is connected: real ranks start
        training only after ``init_process_group`` has seen them all."""
        if self.released or len(self._channels.connected_ranks()) < self.world_size:
            return
        self.released = True
        for process in self.processes:
            with contextlib.suppress(BrokenPipeError):  # it died: its ranks' failures say so
                self._tell(process, b"go\n")

    @staticmethod
    def _tell(process: subprocess.Popen[bytes], line: bytes) -> None:
        assert process.stdin is not None
        try:
            if process.poll() is None:
                process.stdin.write(line)
        finally:
            process.stdin.close()

    def wait_events(self, timeout: float | None) -> list[Any]:
        events, exited = self._wait(timeout)
        self._release_when_all_connected()
        for handle in exited:
            number = self.exit_handles.pop(handle)
            self._channels.unwatch(handle)
            os.close(handle)
            process = self.processes[number]
            process.wait()
            for rank in self.layout[number]:
                events += [*self._channels.drain_rank(rank), self.worker_exited(rank, process.returncode)]
        return events

    def victim_pid(self) -> int:
        return self.processes[-1].pid

    def stop(self) -> None:
        for process in self.processes:
            if process.stdin is not None and not process.stdin.closed:  # never released
                with contextlib.suppress(BrokenPipeError):
                    process.stdin.close()
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        for process in self.processes:
            process.wait()
        for handle in self.exit_handles:
            os.close(handle)
        self.exit_handles.clear()
        self._close_channels()


def _layout(world_size: int, per_process: int) -> list[list[int]]:
    """Ranks 0 .. N-2 in processes of ``per_process``; rank N-1 alone, last."""
    body = list(range(world_size - 1))
    return [body[start : start + per_process] for start in range(0, len(body), per_process)] + [[world_size - 1]]


class Probe:
    """What the driver's listeners hear, timed (a lockstep Callback)."""

    def __init__(self, world_size: int, reports: int) -> None:
        self.world_size = world_size
        self.reports = reports
        self.connected_at: float | None = None
        self.cpu_at: dict[int, tuple[float, float]] = {}  # report index -> (user, system) CPU s
        self.committed_at: float | None = None
        self.kill_due = threading.Event()
        self.killed_at: float | None = None
        self.failed_at: float | None = None
        self.error = ""

    def as_callback(self) -> Any:
        from lockstep.callbacks import Callback

        probe = self

        class _Probe(Callback):
            def on_workers_changed(self, run: Any, alive: int) -> None:
                if alive == probe.world_size and probe.connected_at is None:
                    probe.connected_at = time.time()

            def after_report(self, run: Any, index: int, metrics: dict[str, Any]) -> None:
                usage = resource.getrusage(resource.RUSAGE_SELF)
                probe.cpu_at[index] = (usage.ru_utime, usage.ru_stime)
                if index == probe.reports + 2:  # the last report before the victim waits
                    probe.kill_due.set()

            def on_checkpoint(self, run: Any, index: int, checkpoint: Any) -> None:
                probe.committed_at = time.time()

            def on_failure(self, run: Any, error: Exception, restarting: bool) -> None:
                probe.failed_at = time.time()
                probe.error = str(error)

        return _Probe()


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _peak_rss_mib() -> float:
    """This process's peak RSS since it started (``VmHWM``). Not ``ru_maxrss``: Linux carries
    that over from the parent that forked this process (whose RSS, torch imported, is ~700 MiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one_size(args: argparse.Namespace) -> dict[str, Any]:
    """One fit of ``args.one`` scripted ranks; the figures as a dict."""
    from lockstep._internal.persist.storage import RunStorage
    from lockstep._internal.run.driver import RunDriver
    from lockstep._internal.run.worker_group import GroupFactory
    from lockstep.config import FailureConfig, RunConfig, ScalingConfig
    from lockstep.errors import TrainingFailedError

    _raise_fd_limit()
    size = args.one
    workdir = Path(tempfile.mkdtemp(prefix="lockstep_scale_"))
    stats_dir = workdir / "stats"
    stats_dir.mkdir()
    probe = Probe(size, args.reports)
    run_config = RunConfig(
        name=f"scale_{size}",
        storage_path=str(workdir / "results"),
        failure_config=FailureConfig(max_failures=0),
        callbacks=[probe.as_callback()],
    )
    storage = RunStorage.for_run(str(workdir / "results"), run_config.name)
    driver = RunDriver(storage, run_config, ScalingConfig(num_workers=size), has_resume_checkpoint=False)
    script = {
        "reports": args.reports,
        "interval_s": args.interval_ms / 1000,
        "output_s": args.output_s,
        "lines_per_s": args.lines_per_s,
        "run_path": storage.path_of(),
        "stats_dir": str(stats_dir),
    }
    group_class = _scripted_group_class()
    groups: list[Any] = []

    def start_group(world_size: int) -> Any:
        groups.append(group_class(world_size, driver.log_dir, script, args.ranks_per_process))
        return groups[-1]

    def kill_victim() -> None:
        probe.kill_due.wait()
        probe.killed_at = time.time()
        os.kill(groups[0].victim_pid(), signal.SIGKILL)

    killer = threading.Thread(target=kill_victim, daemon=True)
    killer.start()
    started = time.time()
    try:
        try:
            driver.run(GroupFactory(executor="scripted", start_group=start_group, min_workers=size, max_workers=size))
            raise RuntimeError("the run ended without the lost rank failing it")
        except TrainingFailedError:
            pass
        peak_rss_mib = _peak_rss_mib()
        return _figures(size, args, probe, started, stats_dir, Path(driver.log_dir), peak_rss_mib)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # the run's files and rank logs: read by _figures


def _figures(
    size: int,
    args: argparse.Namespace,
    probe: Probe,
    started: float,
    stats_dir: Path,
    log_dir: Path,
    peak_rss_mib: float,
) -> dict[str, Any]:
    stats = [json.loads(path.read_text()) for path in sorted(stats_dir.glob("process_*.json"))]
    round_trips = sorted(trip for item in stats for trip in item["round_trips_s"])
    sent = max(item["checkpoint_report_sent_at"] for item in stats)
    first, last = 1, args.reports - 1  # report 0 comes right after the connect: left out
    (user_first, system_first), (user_last, system_last) = probe.cpu_at[first], probe.cpu_at[last]
    user_per_report = (user_last - user_first) / (last - first)
    system_per_report = (system_last - system_first) / (last - first)
    written = {int(rank): count for item in stats for rank, count in item["lines_written"].items()}
    victim = size - 1
    named = f"rank {victim}" in probe.error
    return {
        "ranks": size,
        "connect_s": probe.connected_at - started,
        "report_p50_ms": 1000 * statistics.median(round_trips),
        "report_p99_ms": 1000 * round_trips[min(len(round_trips) - 1, int(0.99 * len(round_trips)))],
        "commit_s": probe.committed_at - sent,
        "driver_cpu_ms_per_report": 1000 * (user_per_report + system_per_report),
        "driver_user_ms_per_report": 1000 * user_per_report,
        "driver_system_ms_per_report": 1000 * system_per_report,
        "driver_rss_mib": peak_rss_mib,
        "output_lines_lost": _lines_lost(log_dir, written),
        "output_block_ms": 1000 * max(item["longest_output_write_s"] for item in stats),
        "lost_rank_named_s": (probe.failed_at - probe.killed_at)
        if named and probe.failed_at and probe.killed_at
        else None,
        "error_names_rank": named,
    }


def _lines_lost(log_dir: Path, written: dict[int, int]) -> int:
    lost = 0
    for rank, count in written.items():
        path = log_dir / f"rank_{rank}.log"
        text = path.read_text() if path.exists() else ""
        found = {line.split()[3] for line in text.splitlines() if line.startswith(f"rank {rank} line ")}
        lost += count - len(found)
    return lost


# -- the benchmark: sizes interleaved over rounds ------------------------------------------------

FIELDS = (
    "connect_s",
    "report_p50_ms",
    "report_p99_ms",
    "commit_s",
    "driver_cpu_ms_per_report",
    "driver_rss_mib",
    "output_lines_lost",
    "output_block_ms",
    "lost_rank_named_s",
    "driver_user_ms_per_report",
    "driver_system_ms_per_report",
)


def scale_line(figures: dict[str, Any]) -> str:
    """The ``SCALE ranks=N ...`` line of one size (medians over rounds)."""
    parts = [f"ranks={figures['ranks']}"]
    for name in FIELDS:
        value = figures.get(name)
        parts.append(
            f"{name}=" + ("n/a" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value))
        )
    return "SCALE " + " ".join(parts)


def run_size_process(size: int, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--one",
        str(size),
        "--reports",
        str(args.reports),
        "--interval-ms",
        str(args.interval_ms),
        "--output-s",
        str(args.output_s),
        "--lines-per-s",
        str(args.lines_per_s),
        "--ranks-per-process",
        str(args.ranks_per_process),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=SIZE_TIMEOUT_S, check=False)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("FIGURES ")]
    if completed.returncode != 0 or not lines:
        raise RuntimeError(f"{size} ranks failed (exit {completed.returncode}):\n{completed.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("FIGURES "))


def medians(samples: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"ranks": samples[0]["ranks"]}
    for name in FIELDS:
        values = [sample[name] for sample in samples if sample.get(name) is not None]
        summary[name] = statistics.median(values) if values else None
    summary["output_lines_lost"] = sum(sample["output_lines_lost"] for sample in samples)
    return summary


GOALS = (  # (field, limit, statistic's unit) at the largest size, fixed before measuring
    ("connect_s", 5.0, "s"),
    ("report_p50_ms", 20.0, " ms"),
    ("report_p99_ms", 50.0, " ms"),
    ("commit_s", 2.0, "s"),
    ("driver_cpu_ms_per_report", 20.0, " ms"),
    ("driver_rss_mib", 1024.0, " MiB"),
    ("output_block_ms", 100.0, " ms"),
    ("lost_rank_named_s", 2.0, "s"),
)


def judge(by_size: dict[int, list[dict[str, Any]]]) -> list[Goal]:
    largest = max(by_size)
    samples = by_size[largest]
    goals = []
    for name, limit, unit in GOALS:
        values = [sample[name] for sample in samples if sample.get(name) is not None]
        if len(values) < len(samples):
            values = []  # a round that could not measure it (e.g. the error did not name the rank)
        value = statistics.median(values) if values else float("inf")
        goals.append(
            Goal(
                f"{largest} ranks: {name}",
                f"median over {len(samples)} rounds of the per-round figure",
                value,
                limit,
                unit=unit,
                ci95=bootstrap_ci(values) if len(values) > 1 else None,
                rounds=len(samples),
            )
        )
    lost = sum(sample["output_lines_lost"] for sample in samples)
    goals.append(
        Goal(f"{largest} ranks: output lines lost", f"sum over {len(samples)} rounds", lost, 0.0, rounds=len(samples))
    )
    smallest = min(by_size)
    if smallest < largest:
        ratio = statistics.median(sample["driver_cpu_ms_per_report"] for sample in samples) / statistics.median(
            sample["driver_cpu_ms_per_report"] for sample in by_size[smallest]
        )
        goals.append(
            Goal(
                f"driver CPU per report, {largest} / {smallest} ranks (at most linear)",
                "ratio of the medians over rounds",
                ratio,
                largest / smallest,
                rounds=len(samples),
            )
        )
    return goals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reports", type=int, default=100)
    parser.add_argument("--interval-ms", type=float, default=50.0)
    parser.add_argument("--output-s", type=float, default=30.0)
    parser.add_argument("--lines-per-s", type=float, default=20.0)
    parser.add_argument("--ranks-per-process", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="64 and 128 ranks, 1 round, short phases")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    add_results_args(parser)
    args = parser.parse_args(argv)
    if args.one is not None:
        print("FIGURES " + json.dumps(run_one_size(args)), flush=True)
        return
    if args.quick:
        args.ranks, args.rounds, args.reports, args.output_s = [64, 128], 1, 20, 3.0
    info = describe_machine()
    print(machine_line(info), flush=True)
    by_size: dict[int, list[dict[str, Any]]] = {size: [] for size in args.ranks}
    for round_number in range(args.rounds):
        for size in args.ranks:
            figures = run_size_process(size, args)
            by_size[size].append(figures)
            print(f"round {round_number + 1}: " + scale_line(figures), flush=True)
    lines = [scale_line(medians(samples)) for samples in by_size.values()]
    goals = judge(by_size)
    text = "\n".join(["```text", *lines, "```", "", goals_markdown(goals)])
    print("\n".join(lines))
    print(goals_markdown(goals))
    command = "python benchmarks/scale_bench.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    document = {
        "samples": {str(size): samples for size, samples in by_size.items()},
        "summary": [medians(samples) for samples in by_size.values()],
    }
    kind = "scale" if max(args.ranks) >= 1024 else "scale-small"  # make bench's sizes don't replace the 1,024 run
    path = write_result(args.results_dir, kind, command, info, args.quick, document, goals, text)
    if path is not None:
        print(f"results: {path}")


if __name__ == "__main__":
    main()
