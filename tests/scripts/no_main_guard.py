# A script in the seeds' style: the dataset and the train function at module level, the legacy
# session API, and fit() called with no `if __name__ == "__main__":` guard. lockstep must run it
# without re-running the script in the workers. Each run of the module body leaves a line in
# $SCRIPT_RUNS_FILE, so the test can count them.
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep as train
from lockstep import session
from lockstep.config import ScalingConfig
from lockstep.torch import TorchTrainer

with open(os.environ["SCRIPT_RUNS_FILE"], "a") as runs:
    runs.write(f"{os.getpid()}\n")

training_data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))


def train_func(config):
    if os.environ.get("FAIL_IN_TRAIN"):
        raise RuntimeError("failing on purpose in " + os.environ["FAIL_IN_TRAIN"])
    loader = train.torch.prepare_data_loader(DataLoader(training_data, batch_size=config["batch_size"]))
    model = train.torch.prepare_model(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(config["epochs"]):
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(inputs), labels)
            loss.backward()
            optimizer.step()
        session.report(dict(loss=loss.item(), epoch=epoch, world=session.get_world_size()))


trainer = TorchTrainer(
    train_loop_per_worker=train_func,
    train_loop_config={"batch_size": 5, "epochs": 2},
    scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
    run_config=train.RunConfig(storage_path=sys.argv[1], name="no_guard"),
)
result = trainer.fit()
print("RESULT " + json.dumps(result.metrics))
