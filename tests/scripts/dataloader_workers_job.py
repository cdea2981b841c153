# A train function reading a DataLoader with num_workers=2; each loader worker process leaves
# its pid in argv[2]. argv[3]: "finish" (two epochs), "fail" (raises mid-epoch) or "forever"
# (reads until interrupted). tests/test_crash_safety.py checks those processes end with the run.
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer


class MarkingDataset(Dataset):
    """Small tensors; the process that loads an item leaves a file named by its pid."""

    def __init__(self, marks: str, slow_s: float) -> None:
        self.marks = marks
        self.slow_s = slow_s

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        mark = os.path.join(self.marks, str(os.getpid()))
        if not os.path.exists(mark):
            open(mark, "w").close()
        time.sleep(self.slow_s)
        return torch.full((4,), float(index))


def train_func(config):
    mode = config["mode"]
    loader = DataLoader(
        MarkingDataset(config["marks"], 0.01 if mode == "forever" else 0.0), batch_size=8, num_workers=2
    )
    epochs = 2 if mode != "forever" else 10_000
    for epoch in range(epochs):
        total = 0.0
        for step, batch in enumerate(loader):
            total += float(batch.sum())
            if mode == "fail" and step == 1:  # batches 0 and 1 come from the two loader workers
                raise RuntimeError("planned failure with the loader's workers running")
        lockstep.report({"epoch": epoch, "total": total})


if __name__ == "__main__":
    storage_path, marks, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    TorchTrainer(
        train_func,
        train_loop_config={"marks": marks, "mode": mode},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage_path, name=f"loader-{mode}"),
    ).fit()
    print("FINISHED")
