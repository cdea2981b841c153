# A run whose driver gets two SIGTERMs (a preemption notice, then "stop now") while its ranks
# write checkpoint "epoch_0" (a slow checkpoint_upload_fn into the run folder): argv =
# storage_path, "first" | "again". tests/test_checkpoint_uploads.py runs it twice: the second
# run must not find the first run's half-written files in its own epoch_0.
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import lockstep
from lockstep import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer


def slow_upload(checkpoint, name):
    folder = os.path.join(lockstep.get_context().get_storage().run_path, name)
    os.makedirs(folder, exist_ok=True)
    Path(folder, "half_written_by_the_first_run.pt").write_text("stale")
    time.sleep(30)
    return Checkpoint(folder)


def train_func(config):
    rank = lockstep.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, f"model{rank}.pt").write_text("new")
        if config["first"] and rank == 0:

            def two_notices():
                time.sleep(1)
                os.kill(config["driver"], signal.SIGTERM)
                time.sleep(0.5)
                os.kill(config["driver"], signal.SIGTERM)

            threading.Thread(target=two_notices, daemon=True).start()
        upload = slow_upload if config["first"] else None
        lockstep.report(
            {"epoch": 0},
            checkpoint=Checkpoint.from_directory(folder),
            checkpoint_dir_name="epoch_0",
            checkpoint_upload_fn=upload,
        )


if __name__ == "__main__":
    storage_path, which = sys.argv[1:3]
    result = TorchTrainer(
        train_func,
        train_loop_config={"first": which == "first", "driver": os.getpid()},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="preempted", storage_path=storage_path, failure_config=FailureConfig(preemption_grace_s=60)
        ),
    ).fit()
    print("CHECKPOINT FILES", sorted(os.listdir(result.checkpoint.path)))
