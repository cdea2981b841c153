"""A thousand kills: SIGKILL the driver, one rank, or the whole job at a random moment of a run
that checkpoints at every step, then run it again, trial after trial; check after each one that
nothing half-written counts.

What a trial does
-----------------
A run (2 ranks, 16 steps of 0.15 s, a checkpoint at every step, SYNC and ASYNC uploads alternating,
``num_to_keep=3``) goes on local disk or on the S3 test server (tests/s3_server.py), the two
taking turns. Each trial starts the run's driver (this script, ``driver`` subcommand, as its own
process): the first trial of a run starts it, later ones continue it from its latest checkpoint.
At a random moment it SIGKILLs the driver, one rank's process, or every process of the job,
unless the run ended first: in a quarter of the trials while the job starts (uniform between 0
and ``--max-delay`` seconds after the driver's start), in the others while it trains (uniform
over the run's steps, counted from the moment its rank processes exist), when checkpoints are
being written, uploaded, committed and deleted. Then it checks:

* **whole**: every checkpoint the run record counts verifies by its manifest (each file's size
  and checksum), and the record names no folder that is gone;
* **history**: the report history's indices are 0, 1, 2, ... with no gap and no repeat; no report
  recorded before the trial went missing; every counted checkpoint's report is in the history
  and names it;
* **resume**: the run resumed from the newest checkpoint committed before the trial (rank 0 of
  each attempt notes the step it resumed from; not observed when the kill came before that);
* **no leftovers**: no process of the job outlives the kill by more than 10 s (leftovers are
  counted, then killed);
* **no unexpected failure**: the driver ends by the kill, or finishes, or (a rank killed) fails
  with that rank's death; any other failure of the run counts.

A run that reaches its last step is done; the next trial of that store starts a new run. Trials
append one JSON line each to ``--results`` (default benchmarks/results/kill_trials.jsonl), so an
interrupted series continues where it stopped: ``--trials`` is the total wanted in that file.

How to run
----------
::

    .venv/bin/python benchmarks/kill_trials.py --trials 1000          # make kill-trials
    .venv/bin/python benchmarks/kill_trials.py --trials 20 --results /tmp/k.jsonl --stores local
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TAG_VARIABLE = "LOCKSTEP_KILL_TRIAL"
STEPS = 16
TARGETS = ("driver", "rank", "job")
CHECKS = ("whole", "history", "resume", "no_leftovers", "unexpected_failure")


# -- the run under test (``kill_trials.py driver ...``, in its own process) -----------------------


def train(config: dict[str, Any]) -> None:
    """Resume from the latest checkpoint (verified on load), then checkpoint every step."""
    import lockstep
    from lockstep import Checkpoint

    rank = lockstep.get_context().get_world_rank()
    Path(config["pids"], f"rank_{rank}.pid").write_text(str(os.getpid()))  # the harness kills ranks by pid
    first = 0
    start = lockstep.get_checkpoint()
    if start is not None:
        with start.as_directory() as folder:
            first = int(Path(folder, "step.txt").read_text()) + 1
    if rank == 0:
        with open(config["resumes"], "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"trial": config["trial"], "resumed_after_step": first - 1}) + "\n")
    for step in range(first, config["steps"]):
        time.sleep(config["pace_s"])  # the step's work
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            Path(folder, f"rank{rank}.bin").write_bytes(os.urandom(random.randint(1 << 14, 1 << 18)))
            mode = "ASYNC" if step % 2 else "SYNC"
            lockstep.report({"step": step}, checkpoint=Checkpoint.from_directory(folder), checkpoint_upload_mode=mode)


def drive(args: argparse.Namespace) -> int:
    """Run (or continue) the run ``args.name``; exit 0 when it finished, 1 when it failed."""
    from lockstep import CheckpointConfig, RunConfig, ScalingConfig, TrainingFailedError
    from lockstep.torch import TorchTrainer

    config = {
        "steps": args.steps,
        "pace_s": args.pace_s,
        "resumes": args.resumes,
        "trial": args.trial,
        "pids": args.pids,
    }
    trainer = TorchTrainer(
        train,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name=args.name, storage_path=args.storage, checkpoint_config=CheckpointConfig(num_to_keep=3)
        ),
    )
    try:
        trainer.fit()
    except TrainingFailedError as error:
        print(f"FAILED {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


# -- processes -------------------------------------------------------------------------------------


def tagged(tag: str) -> list[int]:
    """The processes carrying ``TAG_VARIABLE=tag`` (the driver, its warm process, the ranks)."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            continue
    return found


def rank_processes(tag: str, pids: Path) -> list[int]:
    """The job's rank processes that are running: each rank writes its pid into ``pids``."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    running = []
    for path in sorted(pids.glob("rank_*.pid")):
        try:
            pid = int(path.read_text())
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                running.append(pid)
        except (OSError, ValueError):  # gone, or its pid file half-written
            continue
    return running


def kill(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that still exists."""
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def leftovers(tag: str, driver: subprocess.Popen[bytes], within_s: float = 10.0) -> list[int]:
    """The job's processes still there ``within_s`` after the driver ended (then killed)."""
    deadline = time.monotonic() + within_s
    while (left := [pid for pid in tagged(tag) if pid != driver.pid]) and time.monotonic() < deadline:
        time.sleep(0.05)
    kill(left)
    return left


# -- what storage holds -----------------------------------------------------------------------------


def snapshot(storage: str, name: str) -> dict[str, Any]:
    """The run's record, history and checkpoint checks as storage holds them now."""
    from lockstep._internal.persist.run_check import check_run
    from lockstep._internal.persist.storage import RunStorage

    run = RunStorage.for_run(storage, name)
    if hasattr(run.filesystem, "invalidate_cache"):
        run.filesystem.invalidate_cache()
    record = run.read_record()
    if record is None:
        return {"record": None, "history": [], "checks": [], "latest_step": -1}
    history = run.read_reports()
    checks = check_run(run, record)
    latest = record.get("checkpoints", [])[-1] if record.get("checkpoints") else None
    return {
        "record": record,
        "history": history,
        "checks": checks,
        "latest_step": latest["metrics"]["step"] if latest else -1,
    }


def problems_of(before: dict[str, Any], after: dict[str, Any], resumed: int | None) -> dict[str, list[str]]:
    """What each check found wrong (empty lists: all well)."""
    found: dict[str, list[str]] = {check: [] for check in CHECKS}
    found["whole"] = [check.line() for check in after["checks"] if check.state != "whole"]
    indices = [report["report_index"] for report in after["history"]]
    if indices != list(range(len(indices))):
        found["history"].append(f"report indices are {indices}, not 0..{len(indices) - 1}")
    if len(indices) < len(before["history"]):
        found["history"].append(f"{len(before['history'])} reports before the trial, {len(indices)} after")
    by_index = {report["report_index"]: report for report in after["history"]}
    for entry in (after["record"] or {}).get("checkpoints", []):
        report = by_index.get(entry["report_index"])
        if report is None or report.get("checkpoint_dir_name") != entry["dir_name"]:
            found["history"].append(f"{entry['dir_name']} (report {entry['report_index']}) is not in the history")
    if resumed is not None and resumed != before["latest_step"]:
        found["resume"].append(f"resumed after step {resumed}, the newest checkpoint was step {before['latest_step']}")
    return found


# -- trials ---------------------------------------------------------------------------------------


def resumed_after(resumes: Path, trial: int) -> int | None:
    """The step the trial's run resumed after (-1: from the start), None if not observed."""
    if not resumes.exists():
        return None
    for line in resumes.read_text().splitlines():
        entry = json.loads(line) if line.endswith("}") else {}
        if entry.get("trial") == trial:
            return int(entry["resumed_after_step"])
    return None


def one_trial(trial: int, store: str, storage: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start (or continue) run ``name``, kill it at a random moment, check what storage holds."""
    rng = random.Random(args.seed * 1_000_003 + trial)
    target, phase = rng.choice(TARGETS), "start" if rng.random() < 0.25 else "training"
    delay = rng.uniform(0.0, args.max_delay if phase == "start" else args.steps * args.pace_s * 1.1)
    before = snapshot(storage, name)
    tag = uuid.uuid4().hex
    resumes = Path(args.work_dir) / f"{name}.resumes.jsonl"
    log = Path(args.work_dir) / f"trial_{trial}.log"
    pids = Path(args.work_dir) / f"trial_{trial}.pids"
    pids.mkdir()
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "driver",
        "--storage",
        storage,
        "--name",
        name,
        "--steps",
        str(args.steps),
        "--pace-s",
        str(args.pace_s),
        "--trial",
        str(trial),
        "--resumes",
        str(resumes),
        "--pids",
        str(pids),
    ]
    started = time.monotonic()
    with open(log, "wb") as output:
        driver = subprocess.Popen(
            command, env={**os.environ, TAG_VARIABLE: tag}, stdout=output, stderr=output, cwd=REPO
        )
    try:
        killed = wait_or_kill(driver, tag, pids, target, delay, phase)
        driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    left = leftovers(tag, driver)
    after = snapshot(storage, name)
    problems = problems_of(before, after, resumed_after(resumes, trial))
    problems["no_leftovers"] = [f"{len(left)} processes outlived the kill by 10 s"] if left else []
    failure = failure_line(log)
    if driver.returncode not in (0, -signal.SIGKILL) and killed != "rank":
        problems["unexpected_failure"] = [f"the driver exited with {driver.returncode}: {failure}"]
    finished = (after["record"] or {}).get("status") == "finished"
    outcome = {
        "trial": trial,
        "store": store,
        "run": name,
        "target": target,
        "phase": phase,
        "delay_s": round(delay, 3),
        "killed": killed,
        "exit": driver.returncode,
        "seconds": round(time.monotonic() - started, 2),
        "finished": finished,
        "reports": len(after["history"]),
        "checkpoints": len(after["checks"]),
        "problems": {check: lines for check, lines in problems.items() if lines},
    }
    if failure:
        outcome["failure"] = failure
    shutil.rmtree(pids)
    if not outcome["problems"] and not args.keep_logs:
        log.unlink()
    else:
        outcome["log"] = str(log)
    return outcome


def failure_line(log: Path) -> str | None:
    """The driver's ``FAILED ...`` line (its TrainingFailedError), cut short; None if none."""
    text = log.read_text(errors="replace")
    return text.split("FAILED ", 1)[1].split("\n", 1)[0][:300] if "FAILED " in text else None


def wait_for_ranks(driver: subprocess.Popen[bytes], tag: str, pids: Path, timeout_s: float = 60.0) -> bool:
    """Wait until the job's rank processes run the train function (False: the driver ended first)."""
    deadline = time.monotonic() + timeout_s
    while driver.poll() is None and time.monotonic() < deadline:
        if rank_processes(tag, pids):
            return True
        time.sleep(0.02)
    return False


def wait_or_kill(
    driver: subprocess.Popen[bytes], tag: str, pids: Path, target: str, delay: float, phase: str
) -> str | None:
    """Wait ``delay`` s (from the start, or in the training phase from the ranks' start; or for
    the driver to end), then SIGKILL ``target``; returns what was killed."""
    if phase == "training" and not wait_for_ranks(driver, tag, pids):
        return None
    try:
        driver.wait(timeout=delay)
        return None
    except subprocess.TimeoutExpired:
        pass
    if target == "driver":
        kill([driver.pid])
    elif target == "job":
        kill([driver.pid, *tagged(tag)])
    else:
        ranks = rank_processes(tag, pids)
        if not ranks:  # none running (not started yet, or already done): the driver goes instead
            kill([driver.pid])
            return "driver (no rank running)"
        kill([random.Random(delay).choice(ranks)])
    return target


def run_trials(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run trials until ``args.results`` holds ``args.trials``; returns every trial in it."""
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    done = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    runs: dict[str, str] = {}
    for entry in done:  # continue the runs an interrupted series left unfinished
        runs[entry["store"]] = "" if entry["finished"] else entry["run"]
    if len(done) >= args.trials:
        return done
    with storage_roots(args) as roots:
        for trial in range(len(done), args.trials):
            store = args.stores[trial % len(args.stores)]
            if not runs.get(store):
                runs[store] = f"{store}-{args.seed}-{trial:05d}"
            outcome = one_trial(trial, store, roots[store], runs[store], args)
            if outcome["finished"]:
                runs[store] = ""
            with open(results, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(outcome) + "\n")
            done.append(outcome)
            if args.verbose:
                print(json.dumps(outcome), file=sys.stderr, flush=True)
    return done


@contextmanager
def storage_roots(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """A storage_path per store: a folder under the work dir; for s3, the S3 test server's bucket."""
    roots = {"local": str(Path(args.work_dir) / "storage")}
    if "s3" not in args.stores:
        yield roots
        return
    sys.path.insert(0, str(REPO / "tests"))
    from s3_server import s3_environment, s3_server

    with s3_server() as env, s3_environment(env, bucket="kills"):
        roots["s3"] = "s3://kills/runs"
        yield roots


def summary(trials: list[dict[str, Any]]) -> str:
    """The figures as markdown: kills that landed per store, target and phase, and each check's failures."""
    killed = [trial for trial in trials if trial["killed"]]
    failures = collections.Counter(check for trial in trials for check in trial["problems"])
    seconds = sorted(trial["seconds"] for trial in trials)
    lines = [
        f"{len(trials)} trials: {len(killed)} kills landed, {len(trials) - len(killed)} runs ended before their "
        f"kill; {len({trial['run'] for trial in trials})} runs, {sum(trial['finished'] for trial in trials)} of "
        f"them to their last step; median trial {seconds[len(seconds) // 2]:.1f} s.",
        "",
        "| store | kill | while starting | while training |",
        "|---|---|---:|---:|",
    ]
    by = collections.Counter((trial["store"], trial["killed"], trial["phase"]) for trial in killed)
    for store in sorted({trial["store"] for trial in trials}):
        for what in sorted({trial["killed"] for trial in killed if trial["store"] == store}):
            lines.append(f"| {store} | {what} | {by[(store, what, 'start')]} | {by[(store, what, 'training')]} |")
    lines += ["", "| check | trials failing it |", "|---|---:|"]
    lines += [f"| {check} | {failures[check]} |" for check in CHECKS]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command")
    driver = commands.add_parser("driver", help="(internal) the run under test")
    driver.add_argument("--storage", required=True)
    driver.add_argument("--name", required=True)
    driver.add_argument("--steps", type=int, default=STEPS)
    driver.add_argument("--pace-s", type=float, default=0.15)
    driver.add_argument("--trial", type=int, required=True)
    driver.add_argument("--resumes", required=True)
    driver.add_argument("--pids", required=True)
    parser.add_argument("--trials", type=int, default=100, help="trials wanted in the results file (default 100)")
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "kill_trials.jsonl"))
    parser.add_argument("--stores", nargs="+", choices=["local", "s3"], default=["local", "s3"])
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps per run (default {STEPS})")
    parser.add_argument("--pace-s", type=float, default=0.15, help="seconds of work per step (default 0.15)")
    parser.add_argument(
        "--max-delay",
        type=float,
        default=3.0,
        help="a kill during the start comes within this many s of it (default 3)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None, help="local storage and logs (default: a new temp folder)")
    parser.add_argument("--verbose", action="store_true", help="print each trial's line")
    parser.add_argument("--keep-logs", action="store_true", help="keep every driver's log (default: failed trials')")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "driver":
        return drive(args)
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="lockstep_kills_")
    print(f"command: {shlex.join([sys.executable, *sys.argv])}", file=sys.stderr)
    trials = run_trials(args)
    print(summary(trials))
    return 1 if any(trial["problems"] for trial in trials) else 0


if __name__ == "__main__":
    sys.exit(main())
