"""A lockstep script meant to be started by torchrun (tests/test_scripts.py):

    python -m torch.distributed.run --nproc_per_node=2 torchrun_job.py STORAGE_PATH [--num-workers N]
        [--fail-once] [--default-name] [--hang]

Each rank reports steps 0 and 1 (0 to 3 with ``--fail-once``), with a checkpoint in which it
writes the step it reached to ``rank<r>.txt``. A rank given a checkpoint by ``get_checkpoint()``
continues after the step it finds there, and reports that step as ``resumed_from``.

With ``--fail-once``, rank 1 raises before its third report in torchrun's first attempt (run it
with ``--max-restarts=1``); the restarted group continues the run from its checkpoint. The run
is named ``torchrun`` unless ``--default-name`` leaves the name to lockstep.

With ``--hang``, rank 1 waits for ever (on an Event nobody sets) before its third report, while
rank 0 waits in that report; the hang detector's threshold is 2 s (``FailureConfig``).

Each rank prints one line "RANK r PID p RESULT {...}" describing the Result its fit() returned;
the train function reports the pid of the process it runs in, so the test can tell that no other
process ran it.
"""

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.distributed as dist

import lockstep
from lockstep import Checkpoint, FailureConfig, Result, RunConfig, ScalingConfig
from lockstep.torch import TorchConfig, TorchTrainer


def resume_point(rank: int) -> int | None:
    """The step this rank wrote into the checkpoint it was given, or None when it got none."""
    start = lockstep.get_checkpoint()
    if start is None:
        return None
    with start.as_directory() as folder:
        return int(Path(folder, f"rank{rank}.txt").read_text())


def train_func(config: dict) -> int:
    rank = lockstep.get_context().get_world_rank()
    total = torch.ones(1)
    dist.all_reduce(total)
    pids = [None] * lockstep.get_context().get_world_size()
    dist.all_gather_object(pids, os.getpid())
    resumed_from = resume_point(rank)
    first_step = 0 if resumed_from is None else resumed_from + 1
    for step in range(first_step, 4 if config["fail_once"] or config["hang"] else 2):
        if config["fail_once"] and step == 2 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and rank == 1:
            raise RuntimeError("rank 1 fails once on purpose")
        if config["hang"] and step == 2 and rank == 1:
            threading.Event().wait()
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, f"rank{rank}.txt").write_text(str(step))
            lockstep.report(
                {"step": step, "sum": total.item(), "pids": pids, "resumed_from": resumed_from},
                checkpoint=Checkpoint.from_directory(folder),
            )
    return os.getpid()


def describe(result: Result) -> dict:
    """What the test compares between ranks (JSON)."""
    checkpoint = result.checkpoint
    return {
        "path": result.path,
        "metrics": result.metrics,
        "checkpoint": checkpoint and checkpoint.path,
        "checkpoint_files": checkpoint
        and {name: Path(checkpoint.path, name).read_text() for name in sorted(os.listdir(checkpoint.path))},
        "best_checkpoints": [(kept.path, metrics) for kept, metrics in result.best_checkpoints],
        "history": [(row["report_index"], row["step"], row["resumed_from"]) for row in result.metrics_history],
        "num_failures": result.num_failures,
        "error": result.error and str(result.error),
        "return_value": result.return_value,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("storage_path")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--fail-once", action="store_true")
    parser.add_argument("--default-name", action="store_true")
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--start-timeout", type=float, default=120.0, help="TorchConfig.start_timeout_s")
    args = parser.parse_args()
    failure_config = FailureConfig(hang_timeout_s=2.0) if args.hang else FailureConfig()
    result = TorchTrainer(
        train_func,
        train_loop_config={"fail_once": args.fail_once, "hang": args.hang},
        torch_config=TorchConfig(start_timeout_s=args.start_timeout),
        scaling_config=ScalingConfig(num_workers=args.num_workers),
        run_config=RunConfig(
            name=None if args.default_name else "torchrun",
            storage_path=args.storage_path,
            verbose=0,
            failure_config=failure_config,
        ),
    ).fit()
    # One write of the whole line (newline included): the ranks share torchrun's stdout, and a
    # print() of an unbuffered stream writes the text and its newline apart, so lines could mix.
    sys.stdout.write(f"RANK {os.environ['RANK']} PID {os.getpid()} RESULT {json.dumps(describe(result))}\n")
    sys.stdout.flush()
