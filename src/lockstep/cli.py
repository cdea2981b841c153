"""The ``lockstep`` command: list, show and plot runs kept in storage (local paths or URIs).

lockstep runs [STORAGE]                      # default ~/lockstep_results
lockstep show RUN                            # a run folder, or a run name in --storage
lockstep plot RUN [RUN ...] [--metric M ...] -o curves.png   # several runs: overlaid
lockstep dashboard --storage PATH [--port N]  # a web dashboard (see lockstep.dashboard)
lockstep verify RUN                          # check every kept checkpoint against its manifest
lockstep run SCRIPT [ARGS ...]               # python SCRIPT ARGS..., its workers warming from the start
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from lockstep._internal.launch import run_script
from lockstep._internal.output.metrics_text import metrics_text
from lockstep._internal.output.run_plot import StoredRun, plot_runs
from lockstep._internal.persist.filesystems import join, resolve_filesystem
from lockstep._internal.persist.outages import outages_line
from lockstep._internal.persist.results import result_fields
from lockstep._internal.persist.run_check import check_run
from lockstep._internal.persist.run_status import shown_status
from lockstep._internal.persist.storage import RECORD_FILE, RunStorage
from lockstep._internal.run.stragglers import rank_table
from lockstep._internal.start_hook_command import add_start_hook_command, start_hook_command
from lockstep.config import DEFAULT_STORAGE_PATH
from lockstep.result import Result

__all__ = ["main"]


SHOWN_ROWS = 20


# -- finding runs -------------------------------------------------------------------------------


def find_runs(storage_path: str) -> list[StoredRun]:
    """The runs directly under ``storage_path`` (folders holding a run record), oldest first."""
    filesystem, root = resolve_filesystem(storage_path)
    if not filesystem.isdir(root):
        raise FileNotFoundError(f"{storage_path!r} is not a folder; pass the storage_path your runs used.")
    folders = [entry["name"] for entry in filesystem.ls(root, detail=True) if entry.get("type") == "directory"]
    runs = [RunStorage(folder, filesystem) for folder in folders if filesystem.exists(join(folder, RECORD_FILE))]
    found = [(run, run.read_record() or {}) for run in runs]
    return sorted(found, key=lambda stored: stored[1].get("created_at", ""))


def open_run(run: str, storage_path: str) -> StoredRun:
    """A run given as its folder (path or URI), or as a name under ``storage_path``."""
    for storage in (RunStorage(run), RunStorage.for_run(storage_path, run)):
        record = storage.read_record()
        if record is not None:
            return storage, record
    raise FileNotFoundError(
        f"no lockstep run at {run!r} nor named {run!r} in {storage_path!r}; `lockstep runs {storage_path}` lists them."
    )


# -- text ---------------------------------------------------------------------------------------


def runs_table(runs: list[StoredRun]) -> str:
    """One line per run: name, status, reports, last metrics, checkpoints, path."""
    rows = [("NAME", "STATUS", "REPORTS", "LAST METRICS", "CHECKPOINTS", "PATH")]
    for run, record in runs:
        reports = run.read_reports()
        last_metrics = reports[-1]["metrics"] if reports else None
        rows.append(
            (
                record.get("name", run.name),
                shown_status(record),
                str(len(reports)),
                metrics_text(last_metrics, limit=60) if last_metrics else "-",
                str(len(record.get("checkpoints", []))),
                run.display_path,
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


def run_summary(stored: StoredRun, all_rows: bool = False) -> str:
    """What ``lockstep show`` prints: the record, the metrics table, where each rank's time
    went (and the slowest rank, if one holds the others back), and the failure if any."""
    run, record = stored
    reports = run.read_reports()
    result = Result(**result_fields(run, record, reports))
    lines = [
        f"run:          {record.get('name', run.name)}",
        f"path:         {run.display_path}",
        f"status:       {shown_status(record)}",
        f"created:      {record.get('created_at', '?')}   last update: {record.get('updated_at', '-')}",
        f"workers:      {record.get('world_size', '?')} ({record.get('executor', 'local')} executor)",
        f"reports:      {len(result.metrics_history)}   failures: {result.num_failures}",
        f"checkpoints:  {len(record.get('checkpoints', []))} kept; "
        f"latest: {result.checkpoint.path if result.checkpoint else '-'}",
        *([f"storage:      {outages}"] if (outages := outages_line(record)) else []),
        "",
    ]
    frame = result.metrics_dataframe
    if frame is not None and len(frame):
        shown = frame if all_rows or len(frame) <= SHOWN_ROWS else frame.tail(SHOWN_ROWS)
        if len(shown) < len(frame):
            lines.append(f"last {len(shown)} of {len(frame)} reports (--all for every one):")
        table = shown.drop(columns=["timestamp"], errors="ignore").dropna(axis=1, how="all")
        lines += [table.to_string(index=False), ""]
    per_rank = rank_table(reports)
    if per_rank:
        lines += [*per_rank, ""]
    if result.error is not None:
        lines += ["failure:", str(result.error)]
    return "\n".join(lines).rstrip() + "\n"


# -- the command --------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="lockstep", description="List, show and plot lockstep runs; run a script.")
    commands = parser.add_subparsers(dest="command", required=True)
    runs = commands.add_parser("runs", help="list the runs in a storage path")
    runs.add_argument("storage", nargs="?", default=DEFAULT_STORAGE_PATH, help=f"default {DEFAULT_STORAGE_PATH}")
    runs.add_argument("--json", action="store_true", help="one JSON object per run")
    show = commands.add_parser("show", help="a run's summary, metrics and failure")
    show.add_argument("run", help="the run folder (path or URI), or a run name in --storage")
    show.add_argument("--storage", default=DEFAULT_STORAGE_PATH, help="where to look a run name up")
    show.add_argument("--all", action="store_true", help=f"every report, not only the last {SHOWN_ROWS}")
    plot = commands.add_parser("plot", help="draw metrics against the report index (several runs: overlaid)")
    plot.add_argument("run", nargs="+", help="run folders (paths or URIs), or run names in --storage")
    plot.add_argument("--storage", default=DEFAULT_STORAGE_PATH)
    plot.add_argument(
        "--metric", "-m", action="append", help="a metric to draw (repeat it; default: every numeric one)"
    )
    plot.add_argument("-o", "--output", required=True, help="the PNG file to write")
    add_dashboard_command(commands)
    verify = commands.add_parser(
        "verify", help="check every kept checkpoint of a run against its manifest (exit 1 if one is bad)"
    )
    verify.add_argument("run", help="the run folder (path or URI), or a run name in --storage")
    verify.add_argument("--storage", default=DEFAULT_STORAGE_PATH, help="where to look a run name up")
    run = commands.add_parser(
        "run", help="run a training script as python would, its warm workers importing torch from the start"
    )
    run.add_argument("script", help="the Python file to run")
    run.add_argument("arguments", nargs=argparse.REMAINDER, help="the script's own arguments")
    add_start_hook_command(commands)
    return parser.parse_args(argv)


def verify_run(stored: StoredRun) -> int:
    """``lockstep verify``: one line per kept checkpoint; 1 when one is damaged or missing."""
    checks = check_run(*stored)
    for check in checks:
        print(check.line())
    if not checks:
        print(f"{stored[0].display_path} keeps no checkpoint")
    return 1 if any(check.bad for check in checks) else 0


DASHBOARD_HELP = """\
Serve a read-only web dashboard of the runs in a storage path (a folder, or a URI such as
s3://bucket/prefix): the runs, each run's live curves, ranks, checkpoints, errors, logs and
config, and several runs side by side. It reads storage only; it never talks to the runs.

From a laptop, through an SSH tunnel to the machine that runs it (it listens on
127.0.0.1 there, so nothing else can reach it):

  on the training machine:  lockstep dashboard --storage ~/lockstep_results --port 8267
  on the laptop:            ssh -N -L 8267:127.0.0.1:8267 you@training-machine
  then open                 http://localhost:8267/

Listening on another address (--host 0.0.0.0) needs a token: give --token (or set
LOCKSTEP_DASHBOARD_TOKEN), or one is made up; the URL printed at the start carries it.
Needs pip install 'lockstep[dashboard]'.
"""


def add_dashboard_command(commands: Any) -> None:
    """The ``dashboard`` subcommand's arguments."""
    dashboard = commands.add_parser(
        "dashboard",
        help="a web dashboard of the runs in a storage path",
        description=DASHBOARD_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dashboard.add_argument("--storage", default=DEFAULT_STORAGE_PATH, help=f"default {DEFAULT_STORAGE_PATH}")
    dashboard.add_argument("--port", type=int, default=8267, help="default 8267; 0 picks a free port")
    dashboard.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    dashboard.add_argument("--token", default=None, help="what a browser must present (default: none on loopback)")


def run_dashboard(args: argparse.Namespace) -> None:
    """``lockstep dashboard``: serve until interrupted.

    Raises:
        ImportError: the dashboard's packages are missing; the message says how to install them.
    """
    try:
        from lockstep.dashboard import serve
    except ImportError as error:
        raise ImportError(
            f"`lockstep dashboard` needs Starlette and uvicorn ({error}); install them with "
            "`pip install 'lockstep[dashboard]'`."
        ) from error
    token = args.token or os.environ.get("LOCKSTEP_DASHBOARD_TOKEN") or None
    serve(
        os.path.expanduser(args.storage),
        host=args.host,
        port=args.port,
        token=token,
        announce=lambda url: print(f"dashboard: {url}", flush=True),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``lockstep`` console script; returns the exit status."""
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.command == "run":  # the script's exceptions and exit status are its own
        try:
            return run_script(args.script, _script_arguments(raw))
        except FileNotFoundError as error:
            print(f"lockstep run: {error}", file=sys.stderr)
            return 2
    try:
        return run_command(args)
    except (OSError, ValueError, ImportError) as error:
        print(f"lockstep {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


def run_command(args: argparse.Namespace) -> int:
    """Every command but ``run``; returns the exit status."""
    if args.command == "runs":
        found = find_runs(args.storage)
        if args.json:
            for run, record in found:
                print(json.dumps({**record, "status": shown_status(record), "path": run.display_path}))
        else:
            print(runs_table(found) if found else f"no lockstep runs in {args.storage}")
    elif args.command == "dashboard":
        run_dashboard(args)
    elif args.command == "start-hook":
        return start_hook_command(args.action)
    elif args.command == "verify":
        return verify_run(open_run(args.run, args.storage))
    elif args.command == "show":
        print(run_summary(open_run(args.run, args.storage), args.all), end="")
    else:
        drawn = plot_runs([open_run(run, args.storage) for run in args.run], args.metric, args.output)
        print(f"wrote {args.output} ({', '.join(drawn)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _script_arguments(raw: list[str]) -> list[str]:
    """What follows the script in ``lockstep run SCRIPT ...``, as given (argparse drops a ``--``
    there, which ``python SCRIPT -- x`` passes on to the script)."""
    start = raw.index("run") + 1
    if raw[start : start + 1] == ["--"]:  # lockstep run -- SCRIPT ...
        start += 1
    return raw[start + 1 :]
