"""Three reports on 2 workers; rank 0 prints a line before each (for the progress-line tests).

python progress_job.py STORAGE_PATH [VERBOSE]
"""

import sys

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer


def train_func() -> None:
    for step in range(3):
        if lockstep.get_context().get_world_rank() == 0:
            print(f"rank 0 says {step}", flush=True)
        lockstep.report({"step": step, "loss": 1.0 / (step + 1)})


if __name__ == "__main__":
    verbose = int(sys.argv[2]) if len(sys.argv) > 2 else None
    TorchTrainer(
        train_func,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="progress", storage_path=sys.argv[1], verbose=verbose),
    ).fit()
