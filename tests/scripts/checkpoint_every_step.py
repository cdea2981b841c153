# Checkpoints at every step and resumes from the latest checkpoint: argv = storage_path, run name,
# steps. tests/test_crash_safety.py kills this driver while it writes the run record, then runs
# the same command again. Prints "RESULT {json}" at the end.
import json
import os
import sys
import tempfile

import lockstep
from lockstep import Checkpoint, RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer


def train_func(config):
    start = 0
    checkpoint = lockstep.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder, open(os.path.join(folder, "step.txt")) as handle:
            start = int(handle.read()) + 1
    for step in range(start, config["steps"]):
        print(f"step {step} of the run that started at step {start}", flush=True)
        with tempfile.TemporaryDirectory() as folder:
            if lockstep.get_context().get_world_rank() == 0:
                with open(os.path.join(folder, "step.txt"), "w") as handle:
                    handle.write(str(step))
            lockstep.report({"step": step, "start": start}, checkpoint=Checkpoint.from_directory(folder))


if __name__ == "__main__":
    storage_path, name, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    result = TorchTrainer(
        train_func,
        train_loop_config={"steps": steps},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage_path, name=name),
    ).fit()
    print("RESULT", json.dumps({"metrics": result.metrics, "checkpoint": result.checkpoint.path}))
