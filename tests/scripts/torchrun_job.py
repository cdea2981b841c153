"""A lockstep script meant to be started by torchrun (tests/test_scripts.py):

    python -m torch.distributed.run --nproc_per_node=2 torchrun_job.py STORAGE_PATH [NUM_WORKERS [fail-once]]

With ``fail-once``, rank 1 raises before its third report in torchrun's first attempt (run it
with ``--max-restarts=1``); the restarted group continues the run from its checkpoint.

Each rank prints one line "RANK r PID p RESULT {...}"; the train function reports the pid of
the process it runs in, so the test can tell that no other process ran it.
"""

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

import lockstep
from lockstep import Checkpoint, RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer


def train_func(config: dict) -> int:
    total = torch.ones(1)
    dist.all_reduce(total)
    pids = [None] * lockstep.get_context().get_world_size()
    dist.all_gather_object(pids, os.getpid())
    start = lockstep.get_checkpoint()
    for step in range(int(start is not None) * 2, 4 if config["fail_once"] else 2):
        if config["fail_once"] and step == 2 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            raise RuntimeError("rank 1 fails once on purpose")
        with tempfile.TemporaryDirectory() as folder:
            rank = lockstep.get_context().get_world_rank()
            with open(os.path.join(folder, f"rank{rank}.txt"), "w") as handle:
                handle.write(str(step))
            lockstep.report({"step": step, "sum": total.item(), "pids": pids}, checkpoint=Checkpoint.from_directory(folder))
    return os.getpid()


if __name__ == "__main__":
    num_workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    fail_once = len(sys.argv) > 3 and sys.argv[3] == "fail-once"
    result = TorchTrainer(train_func, train_loop_config={"fail_once": fail_once},
                          scaling_config=ScalingConfig(num_workers=num_workers),
                          run_config=RunConfig(name="torchrun", storage_path=sys.argv[1], verbose=0)).fit()
    summary = {"metrics": result.metrics, "checkpoint": result.checkpoint and sorted(os.listdir(result.checkpoint.path)),
               "return_value": result.return_value}
    print(f"RANK {os.environ['RANK']} PID {os.getpid()} RESULT {json.dumps(summary)}", flush=True)
