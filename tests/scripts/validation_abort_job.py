"""A run whose one checkpoint's validation never ends on its own (tests/test_validation.py
interrupts or kills this driver while it waits for it). The validation function writes its pid
to ``MARKS/started_<n>`` (n: 1, 2, ... one per start), then waits.

    python validation_abort_job.py STORAGE MARKS
"""

import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

import lockstep
from lockstep import Checkpoint, RunConfig, ScalingConfig, ValidationConfig
from lockstep.torch import TorchTrainer

signal.signal(signal.SIGINT, signal.default_int_handler)  # the test's SIGINT is a Ctrl-C here
STORAGE, MARKS = sys.argv[1], Path(sys.argv[2])


def report_one_checkpoint() -> None:
    """Report step 0 with a checkpoint to validate; a resumed run has nothing left to do."""
    if lockstep.get_checkpoint() is not None:
        return
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "step.txt").write_text("0")
        lockstep.report({"step": 0}, checkpoint=Checkpoint.from_directory(folder), validation=True)


def validate_forever(checkpoint: Checkpoint, marks: str) -> dict:
    starts = len(list(Path(marks).glob("started_*")))
    Path(marks, f"started_{starts + 1}").write_text(str(os.getpid()))
    threading.Event().wait()
    return {}


if __name__ == "__main__":
    TorchTrainer(
        report_one_checkpoint,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="aborted", storage_path=STORAGE),
        validation_config=ValidationConfig(
            validate_forever, task_config=lockstep.ValidationTaskConfig(fn_kwargs={"marks": str(MARKS)})
        ),
    ).fit()
