"""A lockstep job to hang up (tests/test_preemption.py): each rank reports a step every 0.1 s
until the process gets SIGHUP.

    python hangup_job.py STORAGE PIDS [--num-workers N]

Run it under torchrun (``--num-workers 2``) or as a plain script in local mode (``--num-workers
0``, the default). Each rank writes its pid to ``PIDS/rank<r>``. Every process that runs fit()
prints one line "RESULT <who> {json}" with the class of what fit() raised (a HangUp is a
BaseException, as KeyboardInterrupt is) and exits with code 1 then.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer


def train_func(config: dict) -> None:
    rank = lockstep.get_context().get_world_rank()
    Path(config["pids"], f"rank{rank}").write_text(str(os.getpid()))
    for step in range(100_000):
        time.sleep(0.1)
        lockstep.report({"step": step})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("storage_path")
    parser.add_argument("pids")
    parser.add_argument("--num-workers", type=int, default=0)
    args = parser.parse_args()
    who = os.environ.get("RANK", "driver")
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"pids": args.pids},
        scaling_config=ScalingConfig(num_workers=args.num_workers),
        run_config=RunConfig(name="preemptible", storage_path=args.storage_path, verbose=0),
    )
    try:
        trainer.fit()
        outcome = {"error": None}
    except BaseException as error:  # noqa: BLE001 - the test wants to know what fit() raised
        outcome = {"error": type(error).__name__, "message": str(error)}
    sys.stdout.write(f"RESULT {who} {json.dumps(outcome)}\n")
    sys.stdout.flush()
    sys.exit(1 if outcome["error"] else 0)
