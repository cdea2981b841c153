"""A long lockstep run across two hosts whose network or machine the test takes away
(tests/test_two_hosts.py):

    python two_host_fault_job.py STORAGE_PATH --steps N [--ray ADDRESS] [--max-failures K]

Under torchrun (without ``--ray``) or on the Ray cluster at ADDRESS (two workers spread over two
nodes; with ``--max-failures`` a restart goes on with what remains). Each rank
all-reduces a one every step (a rank on a lost host holds the others up there), then reports the
step with a checkpoint holding it, and paces itself at a few steps a second. A rank given a
checkpoint continues after its step. The run is named ``faults``.

The driver (under torchrun: each rank's process) prints one line "RESULT {...}" (JSON: the history of
(step, world size, resumed_from), failures, the checkpoint's step) or "FAILED <type>: <message>".
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import lockstep
from lockstep import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from lockstep.torch import TorchConfig, TorchTrainer

STEP_PACE_S = 0.25


def resumed_step() -> int | None:
    """The step written in the checkpoint this rank starts from, or None."""
    start = lockstep.get_checkpoint()
    if start is None:
        return None
    with start.as_directory() as folder:
        return int(Path(folder, "step.txt").read_text())


def train_func(config: dict) -> None:
    context = lockstep.get_context()
    resumed_from = resumed_step()
    for step in range(0 if resumed_from is None else resumed_from + 1, config["steps"]):
        total = torch.ones(1)
        dist.all_reduce(total)
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            lockstep.report(
                {"step": step, "world": context.get_world_size(), "sum": total.item(), "resumed_from": resumed_from},
                checkpoint=Checkpoint.from_directory(folder),
            )
        time.sleep(STEP_PACE_S)


def scaling(args: argparse.Namespace) -> ScalingConfig:
    if args.ray is None:
        return ScalingConfig(num_workers=2)
    import ray
    from two_host_ray_job import wait_for_nodes  # beside this script

    ray.init(address=args.ray, log_to_driver=False)
    wait_for_nodes(2)
    return ScalingConfig(num_workers=2, placement_strategy="SPREAD", placement_timeout_s=60)


def describe(result: lockstep.Result) -> dict:
    checkpoint_step = None
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as folder:
            checkpoint_step = int(Path(folder, "step.txt").read_text())
    return {
        "history": [(row["step"], row["world"], row["resumed_from"]) for row in result.metrics_history],
        "num_failures": result.num_failures,
        "checkpoint_step": checkpoint_step,
        "error": result.error and str(result.error),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("storage_path")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--ray", default=None, help="the Ray cluster's address (else: under torchrun)")
    parser.add_argument("--max-failures", type=int, default=0)
    args = parser.parse_args()
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"steps": args.steps},
        scaling_config=scaling(args),
        torch_config=TorchConfig(start_timeout_s=30),
        run_config=RunConfig(
            name="faults",
            storage_path=args.storage_path,
            verbose=0,
            failure_config=FailureConfig(max_failures=args.max_failures),
        ),
    )
    try:
        result = trainer.fit()
    except Exception as error:  # noqa: BLE001 - the test reads the line
        print(f"FAILED {type(error).__name__}: {error}", flush=True)
        sys.exit(1)
    print("RESULT " + json.dumps(describe(result)), flush=True)
