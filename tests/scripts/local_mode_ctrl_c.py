# Local mode (num_workers=0) whose train function has returned while a slow validation runs:
# argv = storage_path, marker file. The validation writes its pid into the marker, then sleeps;
# tests/test_local_mode.py sends SIGINT (Ctrl-C) to this driver then.
import os
import sys
import tempfile
import time
from pathlib import Path

import lockstep
from lockstep import Checkpoint, RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer
from lockstep.validation import ValidationConfig

MARKER = sys.argv[2]


def validate_for_a_minute(checkpoint):
    Path(MARKER).write_text(str(os.getpid()))
    time.sleep(60)
    return {"score": 1.0}


def train_func():
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "model.txt").write_text("weights")
        lockstep.report({"step": 0}, checkpoint=Checkpoint.from_directory(folder), validation=True)


if __name__ == "__main__":
    TorchTrainer(
        train_func,
        scaling_config=ScalingConfig(num_workers=0),
        run_config=RunConfig(name="ctrl-c", storage_path=sys.argv[1]),
        validation_config=ValidationConfig(validate_for_a_minute),
    ).fit()
