"""A run that reports when the test says: ``gated_run.py STORAGE NAME GATES WORKERS``.

Each rank makes report n once the file ``GATES/<n>`` exists (n = 0, 1, ...) and prints a line to
its log, and returns once ``GATES/finish`` exists. lockstep logs at INFO. The metrics port comes from
``LOCKSTEP_METRICS_PORT`` when the test sets it. Prints ``RESULT <metrics>`` at the end.
"""

import json
import logging
import os
import sys
import time

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer

GATE_BOUND_S = 150.0


def train(config: dict) -> None:
    gates = config["gates"]
    deadline = time.monotonic() + GATE_BOUND_S
    index = 0
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(gates, "finish")):
            return
        if os.path.exists(os.path.join(gates, str(index))):
            print(f"rank {lockstep.get_context().get_world_rank()} makes report {index}", flush=True)
            lockstep.report({"step": index, "loss": 1.0 / (index + 1), "score": index * 0.5})
            index += 1
        else:
            time.sleep(0.02)
    raise TimeoutError(f"no gate opened within {GATE_BOUND_S} s")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lockstep").setLevel(logging.INFO)  # shows the metrics URL, among others
    storage, name, gates, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    result = TorchTrainer(
        train,
        train_loop_config={"gates": gates},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name=name, storage_path=storage),
    ).fit()
    print("RESULT " + json.dumps(result.metrics), flush=True)
