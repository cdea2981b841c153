"""Started by torchrun (tests/test_launch.py): values a script computes at module level are each
process's own, and so are the train function and config each process built.

    python -m torch.distributed.run --nproc_per_node=2 torchrun_own_globals.py STORAGE_PATH

Rank 0 prints one line "SEEN [...]": what each rank saw inside its train function.
"""

import json
import os
import sys

import torch.distributed as dist

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

LOCAL_RANK = int(os.environ["LOCAL_RANK"])
PID = os.getpid()
# an open file as a module global on purpose (can't be pickled), open while the train function runs
SCRATCH = open(os.path.join(sys.argv[1], f"opened_by_rank_{os.environ['RANK']}.txt"), "w")  # noqa: SIM115


def train_func(config: dict) -> None:
    seen = {
        "module_local_rank": LOCAL_RANK,
        "module_pid": PID,
        "pid": os.getpid(),
        "file": os.path.basename(SCRATCH.name),
        "config_rank": config["built_by_rank"],
        "rank": lockstep.get_context().get_world_rank(),
    }
    everyone = [None] * lockstep.get_context().get_world_size()
    dist.all_gather_object(everyone, seen)
    lockstep.report({"seen": everyone})


if __name__ == "__main__":
    os.makedirs(sys.argv[1], exist_ok=True)
    result = TorchTrainer(
        train_func,
        train_loop_config={"built_by_rank": int(os.environ["RANK"])},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="own_globals", storage_path=sys.argv[1], verbose=0),
    ).fit()
    if os.environ["RANK"] == "0":
        print("SEEN " + json.dumps(result.metrics["seen"]), flush=True)
