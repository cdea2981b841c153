"""Checkpoint cost of ``lockstep.report()``: how long the train loop is blocked, SYNC vs ASYNC.

What it measures
----------------
The payload is a ResNet18 state dict (``torchvision.models.resnet18()``, about 45 MB as written
by ``torch.save``). A run has 2 workers; **rank 0 only** saves ``model.pt`` into a fresh temporary
folder and passes it to ``report(checkpoint=...)``; rank 1 calls ``report()`` without a checkpoint
(it still takes part in the collective). Each run makes 1 warm-up report and then ``--reports``
measured ones, one per step, with no training work in between.

For every target (``local``: a folder on local disk; ``s3``: a moto S3 server started on
127.0.0.1 by this script) and every mode (SYNC, ASYNC) it records:

* the time rank 0 is blocked in ``report()`` (median and max over the measured reports of all
  repeats; the ``torch.save`` before it is not counted),
* the wall time of the whole ``TorchTrainer.fit()`` (median over repeats; it includes starting the
  worker processes and, for ASYNC, waiting for the last uploads).

As a baseline ("plain write") the same ``model.pt`` is written without lockstep, one file at a
time: ``shutil.copyfile`` into a folder on the same disk (local), or
``s3fs.S3FileSystem().put_file(local, "bucket/plain/model.pt")`` (s3). Throughput is
bytes / median time, in MB/s (1 MB = 10**6 bytes). Goals: ASYNC blocked / SYNC blocked <= 0.10,
SYNC throughput / plain throughput >= 0.80.

The manifest's cost (issue #24, point 3: every checkpoint carries each file's size and checksum,
computed while the files are copied): a third mode, ``SYNC without checksums``, runs SYNC with
``LOCKSTEP_CHECKPOINT_CHECKSUMS=0`` in the workers (no checksums, no manifest). The cost is
(SYNC blocked median - SYNC-without-checksums blocked median) / SYNC-without-checksums blocked
median. Goals (written before the first measurement, from ROUND3.md): <= 0.25 on local disk,
<= 0.05 on S3.

Repeats are interleaved: each repeat runs, per target, the plain write and then both modes, the
order of the modes alternating from one repeat to the next.

How to run
----------
From the repository root, with the project's venv (needs torch, torchvision, s3fs, moto[server])::

    .venv/bin/python benchmarks/checkpoint_bench.py                      # defaults, a few minutes
    .venv/bin/python benchmarks/checkpoint_bench.py --repeats 3 --reports 5 --json results.json
    .venv/bin/python benchmarks/checkpoint_bench.py --targets local      # no S3 server

Temporary files go under ``--work-dir`` (default: a new folder in the system temp dir, removed at
the end); the moto server is stopped on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from machine import describe_machine, machine_line  # noqa: E402 - benchmarks/ is the script folder
from record import Goal, add_results_args, goals_markdown, write_result  # noqa: E402

import lockstep
from lockstep import Checkpoint, CheckpointUploadMode, RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

MB = 1_000_000
BUCKET = "lockstep-bench"
ASYNC_GOAL = 0.10
THROUGHPUT_GOAL = 0.80
MANIFEST_GOALS = {"local": 0.25, "s3": 0.05}
NO_SUMS = "SYNC_NOSUM"
MODES = ("SYNC", "ASYNC", NO_SUMS)


# -- the train function (runs in the workers) ------------------------------------------------


def train_func(config: dict[str, Any]) -> dict[str, Any]:
    """Save a ResNet18 state dict on rank 0 and report it every step; return rank 0's timings."""
    import torchvision

    rank = lockstep.get_context().get_world_rank()
    if config["mode"] == NO_SUMS:
        os.environ["LOCKSTEP_CHECKPOINT_CHECKSUMS"] = "0"
    mode = CheckpointUploadMode(config["mode"].split("_")[0])
    torch.manual_seed(0)
    state = torchvision.models.resnet18().state_dict() if rank == 0 else None
    blocked: list[float] = []
    saves: list[float] = []
    size = 0
    for step in range(config["warmup"] + config["reports"]):
        with tempfile.TemporaryDirectory(dir=config["tmp_dir"]) as folder:
            checkpoint = None
            if rank == 0:
                started = time.perf_counter()
                torch.save(state, os.path.join(folder, "model.pt"))
                saves.append(time.perf_counter() - started)
                size = os.path.getsize(os.path.join(folder, "model.pt"))
                checkpoint = Checkpoint.from_directory(folder)
            started = time.perf_counter()
            lockstep.report({"step": step}, checkpoint=checkpoint, checkpoint_upload_mode=mode)
            blocked.append(time.perf_counter() - started)
    warmup = config["warmup"]
    return {"blocked_s": blocked[warmup:], "save_s": saves[warmup:], "bytes": size}


# -- the S3 server (a copy of tests/s3_server.py's essentials) --------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """Start moto_server on 127.0.0.1 and yield the AWS environment variables that point at it."""
    executable = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    port = _free_port()
    process = subprocess.Popen(
        [executable, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"moto_server exited with code {process.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"moto_server did not listen on port {port} within 30 s") from None
                time.sleep(0.05)
        yield {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "lockstep-bench",
            "AWS_SECRET_ACCESS_KEY": "lockstep-bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    finally:
        process.kill()
        process.wait()


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in os.environ (workers inherit it) for the duration of the block."""
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# -- measurements -----------------------------------------------------------------------------


def save_payload(path: Path) -> int:
    """Write the ResNet18 state dict to ``path`` (as the workers do); return its size."""
    import torchvision

    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), path)
    return path.stat().st_size


def plain_write_local(source: Path, folder: Path, count: int) -> list[float]:
    """Seconds per ``shutil.copyfile`` of ``source`` into ``folder`` (a new file each time)."""
    folder.mkdir(parents=True, exist_ok=True)
    times = []
    for index in range(count):
        started = time.perf_counter()
        shutil.copyfile(source, folder / f"model_{index}.pt")
        times.append(time.perf_counter() - started)
    shutil.rmtree(folder)
    return times


def plain_write_s3(source: Path, count: int) -> list[float]:
    """Seconds per ``S3FileSystem().put_file`` of ``source`` to ``bucket/plain/model.pt``."""
    import s3fs

    filesystem = s3fs.S3FileSystem(skip_instance_cache=True)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        filesystem.put_file(str(source), f"{BUCKET}/plain/model.pt")
        times.append(time.perf_counter() - started)
    filesystem.rm(f"{BUCKET}/plain", recursive=True)
    return times


def run_lockstep(target: str, mode: str, repeat: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One fit(): 2 workers, warm-up + N reports of rank 0's model.pt in ``mode``."""
    name = f"{target}-{mode.lower()}-{repeat}"
    storage_path = f"s3://{BUCKET}/runs" if target == "s3" else str(work / "runs")
    tmp_dir = work / "train_tmp"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"mode": mode, "warmup": args.warmup, "reports": args.reports, "tmp_dir": str(tmp_dir)},
        scaling_config=ScalingConfig(num_workers=args.num_workers),
        run_config=RunConfig(name=name, storage_path=storage_path),
    )
    started = time.perf_counter()
    result = trainer.fit()
    fit_s = time.perf_counter() - started
    if target == "s3":
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).rm(f"{BUCKET}/runs/{name}", recursive=True)
    else:
        shutil.rmtree(work / "runs" / name)
    return {**result.return_value, "fit_s": fit_s}


# -- report -----------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    """The machine, as benchmarks/machine.py describes it."""
    return describe_machine()


def summarize(raw: dict[str, Any], size: int) -> dict[str, Any]:
    """Medians, maxima, throughputs and goal ratios per target."""
    summary: dict[str, Any] = {}
    for target, entry in raw.items():
        plain = statistics.median(entry["plain_s"])
        rows: dict[str, Any] = {"plain": {"median_s": plain, "max_s": max(entry["plain_s"]), "mb_s": size / MB / plain}}
        for mode in MODES:
            runs = entry[mode]
            blocked = [value for run in runs for value in run["blocked_s"]]
            median = statistics.median(blocked)
            rows[mode] = {
                "blocked_median_s": median,
                "blocked_max_s": max(blocked),
                "mb_s": size / MB / median,
                "fit_median_s": statistics.median(run["fit_s"] for run in runs),
                "save_median_s": statistics.median(value for run in runs for value in run["save_s"]),
            }
        async_ratio = rows["ASYNC"]["blocked_median_s"] / rows["SYNC"]["blocked_median_s"]
        throughput_ratio = rows["SYNC"]["mb_s"] / rows["plain"]["mb_s"]
        rows["async_over_sync_blocked"] = async_ratio
        rows["async_goal_met"] = async_ratio <= ASYNC_GOAL
        rows["sync_over_plain_throughput"] = throughput_ratio
        rows["throughput_goal_met"] = throughput_ratio >= THROUGHPUT_GOAL
        without = rows[NO_SUMS]["blocked_median_s"]
        rows["manifest_cost"] = (rows["SYNC"]["blocked_median_s"] - without) / without
        rows["manifest_goal_met"] = rows["manifest_cost"] <= MANIFEST_GOALS[target]
        summary[target] = rows
    return summary


def markdown(summary: dict[str, Any], size: int, args: argparse.Namespace, info: dict[str, str], command: str) -> str:
    """The results as markdown tables, with the machine and the command."""
    samples = args.repeats * args.reports
    lines = [
        machine_line(info),
        f"Command: `{command}`",
        f"Payload: ResNet18 state dict, {size / MB:.1f} MB, rank 0 only; {args.num_workers} workers; "
        f"{args.warmup} warm-up + {args.reports} reports per fit; {args.repeats} repeats "
        f"(blocked: {samples} samples per row; plain: {samples} writes per target).",
        "",
        "| target | write | blocked median (s) | blocked max (s) | MB/s | fit() wall median (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for target, rows in summary.items():
        plain = rows["plain"]
        lines.append(
            f"| {target} | plain write | {plain['median_s']:.3f} | {plain['max_s']:.3f} | {plain['mb_s']:.0f} | – |"
        )
        for mode in MODES:
            row = rows[mode]
            mb_s = f"{row['mb_s']:.0f}" if mode != "ASYNC" else "–"
            shown = "SYNC without checksums" if mode == NO_SUMS else mode
            lines.append(
                f"| {target} | lockstep {shown} | {row['blocked_median_s']:.3f} | {row['blocked_max_s']:.3f} | "
                f"{mb_s} | {row['fit_median_s']:.2f} |"
            )
    lines += [
        "",
        f"| target | ASYNC / SYNC blocked (goal <= {ASYNC_GOAL:.2f}) | "
        f"| SYNC / plain throughput (goal >= {THROUGHPUT_GOAL:.2f}) | |",
        "|---|---:|---|---:|---|",
    ]
    for target, rows in summary.items():
        lines.append(
            f"| {target} | {rows['async_over_sync_blocked']:.3f} | {'PASS' if rows['async_goal_met'] else 'MISS'} | "
            f"{rows['sync_over_plain_throughput']:.2f} | {'PASS' if rows['throughput_goal_met'] else 'MISS'} |"
        )
    lines += [
        "",
        "| target | manifest cost: SYNC blocked, with / without checksums - 1 | goal | |",
        "|---|---:|---:|---|",
    ]
    for target, rows in summary.items():
        lines.append(
            f"| {target} | {rows['manifest_cost']:+.3f} | <= {MANIFEST_GOALS[target]:.2f} | "
            f"{'PASS' if rows['manifest_goal_met'] else 'MISS'} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--reports", type=int, default=5, help="measured reports per fit (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up reports per fit, not counted (default 1)")
    parser.add_argument(
        "--repeats", type=int, default=5, help="fits per (target, mode), interleaved (default 5: goals need 5)"
    )
    parser.add_argument("--num-workers", type=int, default=2, help="workers per fit (default 2)")
    parser.add_argument("--targets", nargs="+", choices=["local", "s3"], default=["local", "s3"])
    parser.add_argument("--work-dir", type=Path, default=None, help="temporary files (default: a new temp folder)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a check that it works, not a measurement: 1 repeat of 2 reports; results marked quick",
    )
    add_results_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.reports = 1, 2
    if args.reports < 1 or args.repeats < 1 or args.warmup < 0 or args.num_workers < 1:
        parser.error("--reports, --repeats and --num-workers must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    info = machine()
    work = Path(tempfile.mkdtemp(prefix="lockstep_bench_", dir=args.work_dir))
    raw: dict[str, Any] = {target: {"plain_s": [], **{mode: [] for mode in MODES}} for target in args.targets}
    try:
        with maybe_s3_server("s3" in args.targets) as env, environment(env):
            if env:
                import s3fs

                s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
            source = work / "payload" / "model.pt"
            source.parent.mkdir(parents=True)
            size = save_payload(source)
            for repeat in range(args.repeats):
                modes = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
                for target in args.targets:
                    count = args.warmup + args.reports
                    if target == "local":
                        times = plain_write_local(source, work / "plain", count)
                    else:
                        times = plain_write_s3(source, count)
                    raw[target]["plain_s"] += times[args.warmup :]
                    print(
                        f"[repeat {repeat + 1}/{args.repeats}] {target} plain write: "
                        f"median {statistics.median(times[args.warmup :]):.3f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    for mode in modes:
                        run = run_lockstep(target, mode, repeat, args, work)
                        if run["bytes"] != size:
                            raise RuntimeError(f"workers saved {run['bytes']} bytes, the baseline {size}")
                        raw[target][mode].append(run)
                        print(
                            f"[repeat {repeat + 1}/{args.repeats}] {target} {mode}: blocked median "
                            f"{statistics.median(run['blocked_s']):.3f} s, fit {run['fit_s']:.1f} s",
                            file=sys.stderr,
                            flush=True,
                        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(raw, size)
    goals = goals_of(summary, args)
    text = markdown(summary, size, args, info, command) + "\n\n" + goals_markdown(goals)
    print(text)
    document = {
        "partial": set(args.targets) != {"local", "s3"},
        "payload_bytes": size,
        "payload": "resnet18 state_dict, rank 0 only",
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "summary": summary,
        "raw": raw,
    }
    path = write_result(
        args.results_dir, "checkpoint", command, info, args.quick, document, goals, text, headline(summary)
    )
    if path is not None:
        print(f"results: {path}", file=sys.stderr)
    if args.json is not None:
        document = {
            "command": command,
            "machine": info,
            "payload_bytes": size,
            "payload": "resnet18 state_dict, rank 0 only",
            "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
            "goals": {
                "async_over_sync_blocked_max": ASYNC_GOAL,
                "sync_over_plain_throughput_min": THROUGHPUT_GOAL,
                "manifest_cost_max": MANIFEST_GOALS,
            },
            "summary": summary,
            "raw": raw,
        }
        args.json.write_text(json.dumps(document, indent=1))


def goals_of(summary: dict[str, Any], args: argparse.Namespace) -> list[Goal]:
    """The two goals per target, each judged by a ratio of medians over every measured report."""
    samples = args.repeats * args.reports
    goals = []
    for target, rows in summary.items():
        goals.append(
            Goal(
                f"{target}: ASYNC / SYNC time blocked in report()",
                f"ratio of the medians of all blocked times ({samples} reports each)",
                rows["async_over_sync_blocked"],
                ASYNC_GOAL,
            )
        )
        goals.append(
            Goal(
                f"{target}: SYNC / plain-write throughput",
                f"ratio of the medians ({samples} reports, {samples} plain writes)",
                rows["sync_over_plain_throughput"],
                THROUGHPUT_GOAL,
                at_most=False,
            )
        )
        goals.append(
            Goal(
                f"{target}: manifest cost (SYNC blocked with / without checksums - 1)",
                f"ratio of the medians ({samples} reports each)",
                rows["manifest_cost"],
                MANIFEST_GOALS[target],
            )
        )
    return goals


def headline(summary: dict[str, Any]) -> list[dict[str, str]]:
    """Rows for the top-level README's performance table."""
    rows = []
    for target, entry in summary.items():
        where = "local disk" if target == "local" else "a local S3 server (moto)"
        rows.append(
            {
                "what": f"report() with a 47 MB checkpoint to {where}, time blocked (median)",
                "lockstep": f"SYNC {entry['SYNC']['blocked_median_s'] * 1e3:.0f} ms, "
                f"ASYNC {entry['ASYNC']['blocked_median_s'] * 1e3:.0f} ms",
                "compared_with": f"plain write {entry['plain']['median_s'] * 1e3:.0f} ms",
                "ratio": f"SYNC/plain throughput {entry['sync_over_plain_throughput']:.2f} (goal >= {THROUGHPUT_GOAL})",
            }
        )
    return rows


@contextmanager
def maybe_s3_server(wanted: bool) -> Iterator[dict[str, str]]:
    """The moto server's environment when S3 is a target, else an empty one."""
    if not wanted:
        yield {}
        return
    with s3_server() as env:
        yield env


if __name__ == "__main__":
    main()
