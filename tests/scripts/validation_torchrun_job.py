"""Validation under torchrun (tests/test_validation.py): two checkpoints validated; every
process prints "RESULT <rank> <pid> {json}" with the best checkpoints' metrics it got from fit().

    torchrun --nproc_per_node=2 validation_torchrun_job.py STORAGE
"""

import json
import os
import sys
import tempfile

import lockstep
from lockstep import Checkpoint, RunConfig, ScalingConfig, ValidationConfig
from lockstep.torch import TorchTrainer


def validate(checkpoint: Checkpoint) -> dict:
    with open(os.path.join(checkpoint.path, "value.txt")) as handle:
        value = float(handle.read())
    return {"val": value, "pid": os.getpid(), "rank_variable": os.environ.get("RANK")}


def train() -> None:
    for step in range(2):
        with tempfile.TemporaryDirectory() as folder:
            if lockstep.get_context().get_world_rank() == 0:
                with open(os.path.join(folder, "value.txt"), "w") as handle:
                    handle.write(str(step + 1))
            lockstep.report({"step": step}, checkpoint=Checkpoint.from_directory(folder), validation=True)


result = TorchTrainer(
    train,
    scaling_config=ScalingConfig(num_workers=2),
    run_config=RunConfig(name="validated", storage_path=sys.argv[1]),
    validation_config=ValidationConfig(validate),
).fit()
print("RESULT", os.environ["RANK"], os.getpid(), json.dumps([metrics for _, metrics in result.best_checkpoints]))
