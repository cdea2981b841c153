# Reports once, then "trains" until the file named by argv[2] exists (forever if none is given),
# so that a test can kill or interrupt the driver mid-run and then run the same command again.
import logging
import os
import sys
import time

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

logging.basicConfig(level=logging.INFO)
STOP_FILE = sys.argv[2] if len(sys.argv) > 2 else None


def train_func():
    lockstep.report({"started": 1})
    deadline = time.monotonic() + 600
    while not (STOP_FILE and os.path.exists(STOP_FILE)) and time.monotonic() < deadline:
        time.sleep(0.05)


result = TorchTrainer(
    train_func,
    scaling_config=ScalingConfig(num_workers=2),
    run_config=RunConfig(storage_path=sys.argv[1], name="forever"),
).fit()
print("REPORTS", list(result.metrics_dataframe["report_index"]))
