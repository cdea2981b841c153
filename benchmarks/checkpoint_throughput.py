"""Checkpoint throughput: a checkpoint of several GiB from several ranks reaching storage, beside a
plain parallel copy of the same files.

What it measures
----------------
Before anything is timed, each of ``--ranks`` ranks gets a local folder with one file of
``--mib`` MiB (random bytes), as a rank's ``torch.save`` would leave it. Then, per target:

* **plain parallel copy**: one thread per rank copies its file into storage at the same time
  (``shutil.copyfile`` into a folder on the same disk for ``local``; ``s3fs.S3FileSystem().put_file``,
  multipart, for ``s3``), timed from the first start to the last end;
* **lockstep**: a ``TorchTrainer`` fit with ``--ranks`` workers, every rank passing its folder to
  ``report(checkpoint=...)`` (SYNC), ``--reports`` times; the time is rank 0's time in
  ``report()``, which returns once every rank's files are written, checksummed for the manifest,
  and the checkpoint committed;
* **lockstep without checksums** (``LOCKSTEP_CHECKPOINT_CHECKSUMS=0`` in the workers, no
  manifest), to show what the checksums cost; not judged.

Throughput is total bytes / time (GB/s, 1 GB = 10**9 bytes); the figure is the ratio of the
medians, lockstep over plain, over ``--repeats`` interleaved rounds. Goal (issue #24, ROUND3.md):
>= 0.80 on local disk. S3 is the S3 test server (moto, in one process on 127.0.0.1): a check that a
multi-GiB checkpoint from several ranks works there, not a speed reference, so its ratio is shown
but not judged. The S3 files are smaller (``--s3-mib``): the test server holds them in memory.

How to run
----------
::

    .venv/bin/python benchmarks/checkpoint_throughput.py --results-dir benchmarks/results   # ~10 min
    .venv/bin/python benchmarks/checkpoint_throughput.py --quick                             # ~1 min
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from checkpoint_bench import environment, maybe_s3_server  # noqa: E402 - benchmarks/ is the script folder
from machine import describe_machine, machine_line  # noqa: E402
from record import Goal, add_results_args, goals_markdown, write_result  # noqa: E402

import lockstep
from lockstep import Checkpoint, RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

MIB = 1 << 20
GB = 1e9
BUCKET = "lockstep-bench"
LOCAL_GOAL = 0.80


def train_func(config: dict[str, Any]) -> list[float]:
    """Report this rank's prepared folder as a checkpoint ``reports`` times; rank 0's times."""
    rank = lockstep.get_context().get_world_rank()
    if not config["checksums"]:
        os.environ["LOCKSTEP_CHECKPOINT_CHECKSUMS"] = "0"
    folder = config["sources"][rank]
    blocked = []
    for index in range(config["reports"]):
        started = time.perf_counter()
        lockstep.report({"index": index}, checkpoint=Checkpoint.from_directory(folder))
        blocked.append(time.perf_counter() - started)
    return blocked


def prepare_sources(work: Path, ranks: int, mib: int) -> list[str]:
    """One folder per rank holding ``rank_<r>.bin`` of ``mib`` MiB."""
    block = bytearray(os.urandom(64 * MIB))
    folders = []
    for rank in range(ranks):
        folder = work / f"source_{rank}"
        folder.mkdir(parents=True)
        with open(folder / f"rank_{rank}.bin", "wb") as handle:
            left = mib * MIB
            while left > 0:
                block[:8] = os.urandom(8)
                handle.write(block[: min(left, len(block))])
                left -= min(left, len(block))
        folders.append(str(folder))
    return folders


def files_of(sources: list[str]) -> list[Path]:
    return [next(Path(folder).iterdir()) for folder in sources]


def plain_copy(target: str, sources: list[str], work: Path) -> float:
    """Seconds for one thread per rank to copy its file into storage."""
    files = files_of(sources)
    if target == "local":
        destination = work / "plain"
        destination.mkdir()

        def copy(path: Path) -> None:
            shutil.copyfile(path, destination / path.name)
    else:
        import s3fs

        filesystem = s3fs.S3FileSystem(skip_instance_cache=True)

        def copy(path: Path) -> None:
            filesystem.put_file(str(path), f"{BUCKET}/plain/{path.name}")

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(files)) as pool:
        list(pool.map(copy, files))
    seconds = time.perf_counter() - started
    if target == "local":
        shutil.rmtree(work / "plain")
    else:
        filesystem.rm(f"{BUCKET}/plain", recursive=True)
    return seconds


def lockstep_fit(
    target: str, sources: list[str], reports: int, work: Path, name: str, checksums: bool = True
) -> list[float]:
    """Rank 0's seconds in each report() of a fit whose ranks report their folders."""
    storage_path = f"s3://{BUCKET}/runs" if target == "s3" else str(work / "runs")
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"sources": sources, "reports": reports, "checksums": checksums},
        scaling_config=ScalingConfig(num_workers=len(sources)),
        run_config=RunConfig(name=name, storage_path=storage_path),
    )
    blocked = trainer.fit().return_value
    if target == "s3":
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).rm(f"{BUCKET}/runs/{name}", recursive=True)
    else:
        shutil.rmtree(work / "runs" / name)
    return blocked


def measure(target: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Interleaved rounds of plain copies and lockstep fits for one target."""
    mib = args.mib if target == "local" else args.s3_mib
    sources = prepare_sources(work / target, args.ranks, mib)
    total = args.ranks * mib * MIB
    plain: list[float] = []
    ours: list[float] = []
    bare: list[float] = []
    for repeat in range(args.repeats):
        plain.append(plain_copy(target, sources, work))
        ours += lockstep_fit(target, sources, args.reports, work, f"{target}-{repeat}")
        bare += lockstep_fit(target, sources, args.reports, work, f"{target}-{repeat}-bare", checksums=False)
        print(
            f"[{target} {repeat + 1}/{args.repeats}] plain {total / plain[-1] / GB:.2f} GB/s, "
            f"lockstep {total / statistics.median(ours[-args.reports :]) / GB:.2f} GB/s, without checksums "
            f"{total / statistics.median(bare[-args.reports :]) / GB:.2f} GB/s",
            file=sys.stderr,
            flush=True,
        )
    shutil.rmtree(work / target)
    plain_s, ours_s, bare_s = statistics.median(plain), statistics.median(ours), statistics.median(bare)
    return {
        "bytes": total,
        "mib_per_rank": mib,
        "plain_s": plain,
        "lockstep_s": ours,
        "no_checksums_s": bare,
        "plain_gb_s": total / plain_s / GB,
        "lockstep_gb_s": total / ours_s / GB,
        "no_checksums_gb_s": total / bare_s / GB,
        "ratio": plain_s / ours_s,
        "no_checksums_ratio": plain_s / bare_s,
    }


def markdown(summary: dict[str, Any], args: argparse.Namespace, info: dict[str, str], command: str) -> str:
    lines = [
        machine_line(info),
        f"Command: `{command}`",
        f"{args.ranks} ranks, one file each; {args.repeats} interleaved rounds; lockstep: {args.reports} SYNC "
        "reports per fit (rank 0's time in report()).",
        "",
        "| target | checkpoint | plain parallel copy (GB/s) | lockstep (GB/s) | lockstep / plain | goal | "
        "lockstep without checksums (GB/s) | its ratio |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for target, row in summary.items():
        goal = (
            f">= {LOCAL_GOAL:.2f}: {'PASS' if row['ratio'] >= LOCAL_GOAL else 'MISS'}"
            if target == "local"
            else "works (not a speed reference)"
        )
        lines.append(
            f"| {target} | {args.ranks} x {row['mib_per_rank']} MiB | {row['plain_gb_s']:.2f} | "
            f"{row['lockstep_gb_s']:.2f} | {row['ratio']:.2f} | {goal} | {row['no_checksums_gb_s']:.2f} | "
            f"{row['no_checksums_ratio']:.2f} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mib", type=int, default=768, help="MiB per rank on local disk (default 768)")
    parser.add_argument("--s3-mib", type=int, default=128, help="MiB per rank on S3 (default 128)")
    parser.add_argument(
        "--reports",
        type=int,
        default=1,
        help="checkpoints per fit (default 1: as the plain copy, each fit writes the files once "
        "before they are deleted, so both leave as many dirty pages to the kernel)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--targets", nargs="+", choices=["local", "s3"], default=["local", "s3"])
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="2 ranks x 64 MiB (S3: 16 MiB), 1 round")
    add_results_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.mib, args.s3_mib, args.repeats = 2, 64, 16, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    info = describe_machine()
    work = Path(tempfile.mkdtemp(prefix="lockstep_throughput_", dir=args.work_dir))
    summary: dict[str, Any] = {}
    try:
        with maybe_s3_server("s3" in args.targets) as env, environment(env):
            if env:
                import s3fs

                s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
            for target in args.targets:
                summary[target] = measure(target, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    goals = (
        [
            Goal(
                "local: checkpoint throughput, lockstep / plain parallel copy",
                f"ratio of the medians ({args.repeats} copies, {args.repeats * args.reports} reports)",
                summary["local"]["ratio"],
                LOCAL_GOAL,
                at_most=False,
            )
        ]
        if "local" in summary
        else []
    )
    text = markdown(summary, args, info, command) + ("\n\n" + goals_markdown(goals) if goals else "")
    print(text)
    document = {
        "partial": set(args.targets) != {"local", "s3"},
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "summary": summary,
    }
    headline = [
        {
            "what": f"a {args.ranks}-rank checkpoint of {row['bytes'] / GB:.1f} GB to "
            f"{'local disk' if target == 'local' else 'a local S3 server (moto)'}",
            "lockstep": f"{row['lockstep_gb_s']:.2f} GB/s",
            "compared_with": f"plain parallel copy {row['plain_gb_s']:.2f} GB/s",
            "ratio": f"{row['ratio']:.2f}" + (f" (goal >= {LOCAL_GOAL})" if target == "local" else ""),
        }
        for target, row in summary.items()
    ]
    path = write_result(args.results_dir, "throughput", command, info, args.quick, document, goals, text, headline)
    if path is not None:
        print(f"results: {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
