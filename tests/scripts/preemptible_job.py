"""A lockstep job to preempt (tests/test_preemption.py): each rank reports a step every
``--step-s`` seconds, with a checkpoint every ``--every`` steps, up to ``--steps``; a run resumed
from a checkpoint continues after its step. Each rank writes its pid to ``PIDS/rank<r>`` and, at
each report, whether it has heard of a preemption (``notice``: the ranks of
``get_preemption_info()``).

    python preemptible_job.py STORAGE PIDS [--every K] [--steps N] [--step-s S] [--grace G]
        [--callback-fails] [--num-workers N]

Works as a plain script (the local executor) and under torchrun. Every process that runs
fit() prints one line: "RESULT <who> {json}" with how fit() ended.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import lockstep
from lockstep import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from lockstep.callbacks import Callback
from lockstep.torch import TorchTrainer


def train_func(config: dict) -> None:
    rank = lockstep.get_context().get_world_rank()
    Path(config["pids"], f"rank{rank}").write_text(str(os.getpid()))
    start = lockstep.get_checkpoint()
    first = 0
    if start is not None:
        with start.as_directory() as folder:
            first = int(Path(folder, "step.txt").read_text()) + 1
    for step in range(first, config["steps"]):
        time.sleep(config["step_s"])
        info = lockstep.get_preemption_info()
        metrics = {"step": step, "notice": info and info.preempted_ranks, "deadline_ms": info and info.deadline_ms}
        if step % config["every"] == config["every"] - 1:
            with tempfile.TemporaryDirectory() as folder:
                Path(folder, "step.txt").write_text(str(step))
                lockstep.report(metrics, checkpoint=Checkpoint.from_directory(folder))
        else:
            lockstep.report(metrics)


class FailingCallback(Callback):
    """Ends the driver from after_report, once the second report is in: an Exception would only
    switch the callback off, SystemExit ends the process."""

    def after_report(self, run, index, metrics):  # noqa: ANN001, ANN201
        if index >= 1:
            sys.exit("the callback exits on purpose")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("storage_path")
    parser.add_argument("pids")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--grace", type=float, default=25.0)
    parser.add_argument("--callback-fails", action="store_true")
    parser.add_argument("--num-workers", type=int, default=2, help="0: local mode (the train function runs here)")
    args = parser.parse_args()
    who = os.environ.get("RANK", "driver")
    config = {"pids": args.pids, "every": args.every, "steps": args.steps, "step_s": args.step_s}
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.num_workers),
        run_config=RunConfig(
            name="preemptible",
            storage_path=args.storage_path,
            verbose=0,
            failure_config=FailureConfig(preemption_grace_s=args.grace),
            callbacks=[FailingCallback()] if args.callback_fails else [],
        ),
    )
    try:
        result = trainer.fit()
        outcome = {"error": None, "steps": [row["step"] for row in result.metrics_history]}
    except lockstep.TrainingFailedError as error:
        info = getattr(error, "preemption_info", None)
        outcome = {
            "error": type(error).__name__,
            "message": str(error),
            "ranks": info and info.preempted_ranks,
            "drain_timed_out": getattr(error, "drain_timed_out", None),
        }
    sys.stdout.write(f"RESULT {who} {json.dumps(outcome)}\n")
    sys.stdout.flush()
