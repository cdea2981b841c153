# Reports once, then "trains" for a long time, so that a test can kill the driver mid-run.
import sys
import time

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer


def train_func():
    lockstep.report({"started": 1})
    time.sleep(600)


TorchTrainer(
    train_func,
    scaling_config=ScalingConfig(num_workers=2),
    run_config=RunConfig(storage_path=sys.argv[1], name="forever"),
).fit()
