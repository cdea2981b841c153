"""One Ray Train 2.60 script with checkpoint validation, run as it is under Ray Train
(``--framework ray``) or with its imports swapped to lockstep (``--framework lockstep``);
prints, as the last line, what its user sees: each kept checkpoint's status and metrics, the
Result's metrics and best checkpoints (tests/test_validation.py compares the two)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

parser = argparse.ArgumentParser()
parser.add_argument("--framework", choices=["ray", "lockstep"], required=True)
parser.add_argument("--storage", required=True)
parser.add_argument("--address", default=None)
args = parser.parse_args()

if args.framework == "ray":
    import ray
    import ray.train as train
    from ray.train import (
        Checkpoint,
        CheckpointConfig,
        CheckpointConsistencyMode,
        RunConfig,
        ScalingConfig,
        ValidationConfig,
        ValidationTaskConfig,
    )
    from ray.train.torch import TorchTrainer

    ray.init(address=args.address, log_to_driver=False, **({} if args.address else {"num_cpus": 4}))
else:
    import lockstep as train
    from lockstep import (
        Checkpoint,
        CheckpointConfig,
        CheckpointConsistencyMode,
        RunConfig,
        ScalingConfig,
        ValidationConfig,
        ValidationTaskConfig,
    )
    from lockstep.torch import TorchTrainer

VALUES = [5.0, 1.0, 4.0, 2.0, 3.0]
FAILS, HANGS = 2, 4  # the validation of report 2 raises; report 4's runs past its timeout


def validate(checkpoint, offset=0.0, fail=False, hang=False):
    with checkpoint.as_directory() as folder, open(os.path.join(folder, "value.txt")) as handle:
        value = float(handle.read())
    if fail:
        raise ValueError("this checkpoint fails its validation")
    if hang:
        time.sleep(120)
    return {"val_loss": value + offset, "validated_step": int(round(value))}


def train_func():
    rank = train.get_context().get_world_rank()
    for step, value in enumerate(VALUES):
        with tempfile.TemporaryDirectory() as folder:
            if rank == 0:
                with open(os.path.join(folder, "value.txt"), "w") as handle:
                    handle.write(str(value))
            validation = True
            if step == FAILS:
                validation = ValidationTaskConfig(fn_kwargs={"fail": True})
            elif step == HANGS:
                validation = ValidationTaskConfig(fn_kwargs={"hang": True}, timeout_s=2)
            elif step == 3:
                validation = ValidationTaskConfig(fn_kwargs={"offset": 0.5})
            train.report({"step": step}, checkpoint=Checkpoint.from_directory(folder), validation=validation)
    seen = train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.VALIDATED)
    return [
        {"step": reported.metrics["step"], "status": reported.status.value, "metrics": reported.metrics}
        for reported in seen
    ]


trainer = TorchTrainer(
    train_func,
    scaling_config=ScalingConfig(num_workers=2),
    run_config=RunConfig(
        name="same_script",
        storage_path=args.storage,
        checkpoint_config=CheckpointConfig(
            num_to_keep=2, checkpoint_score_attribute="val_loss", checkpoint_score_order="min"
        ),
    ),
    validation_config=ValidationConfig(fn=validate, task_config=ValidationTaskConfig(fn_kwargs={"offset": 0.0})),
)
result = trainer.fit()
with open(os.path.join(result.checkpoint.path, "value.txt")) as handle:
    latest_value = float(handle.read())
print(
    json.dumps(
        {
            "in_train_func": sorted(result.return_value, key=lambda item: item["step"]),
            "result_metrics": result.metrics,
            "best": [metrics for _, metrics in result.best_checkpoints],
            "latest_value": latest_value,
        }
    )
)
