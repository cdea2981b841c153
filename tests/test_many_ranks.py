"""Many ranks: 32 real ranks on this machine run a DDP job to the end and leave nothing behind;
the real driver carries 256 scripted ranks (benchmarks/scale_bench.py) through reports, a
checkpoint every rank wrote into, their output and the loss of one rank; what a run of many ranks
prints stays a few lines (failures and the rank table folded)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep._internal.run.stragglers import rank_table
from lockstep.errors import WorkerFailure, WorkerGroupError
from lockstep.torch import TorchTrainer, prepare_model

REPO = Path(__file__).resolve().parent.parent


def ddp_step_and_report(config: dict[str, Any]) -> dict[str, Any]:
    """A DDP step on a small model and a report per step; what rank 0 saw."""
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = torch.randn(8, 16), torch.randint(0, 2, (8,))
    for step in range(config["steps"]):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        lockstep.report({"step": step, "loss": loss.item()})
    weights = next(model.parameters()).detach().sum().item()
    return {"world_size": lockstep.get_context().get_world_size(), "weights": weights}


@pytest.mark.timeout(240)
def test_32_real_ranks_run_a_ddp_job_to_the_end(storage_path: str, capfd: pytest.CaptureFixture[str]) -> None:
    result = TorchTrainer(
        ddp_step_and_report,
        train_loop_config={"steps": 5},
        scaling_config=ScalingConfig(num_workers=32),
        run_config=RunConfig(storage_path=storage_path, name="many"),
    ).fit()
    assert result.return_value["world_size"] == 32
    assert [row["step"] for _, row in result.metrics_dataframe.iterrows()] == [0, 1, 2, 3, 4]
    assert len(list(Path(storage_path, "many", "logs").glob("rank_*.log"))) == 32
    shown = capfd.readouterr()
    assert "32/32 workers" in shown.err
    assert len(shown.err.splitlines()) < 20, "the driver's console grew with the ranks"


@pytest.mark.timeout(300)
def test_the_real_driver_carries_256_scripted_ranks(tmp_path: Path) -> None:
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "scale_bench.py"),
        "--one",
        "256",
        "--reports",
        "10",
        "--output-s",
        "2",
        "--ranks-per-process",
        "64",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("FIGURES ")]
    assert completed.returncode == 0 and lines, completed.stderr[-3000:]
    figures = json.loads(lines[-1].removeprefix("FIGURES "))
    assert figures["ranks"] == 256
    assert figures["output_lines_lost"] == 0
    assert figures["error_names_rank"], "the error did not name the killed rank"
    assert figures["connect_s"] > 0 and figures["commit_s"] >= 0 and figures["lost_rank_named_s"] is not None


def test_failures_of_many_ranks_fold_into_a_few_paragraphs() -> None:
    failures = [
        WorkerFailure(rank, "WorkerDied", f"rank {rank} lost: its host 10.0.0.2 has not answered", "")
        for rank in range(1, 64)
    ]
    failures.append(WorkerFailure(0, "ValueError", "bad batch", "Traceback ...\nValueError: bad batch"))
    stacks = {rank: '  File "train.py", line 9, in step\n    loss.backward()' for rank in range(64, 70)}
    message = str(WorkerGroupError.from_failures(failures, " (report #3 was next)", stacks))
    assert message.startswith("Training failed on ranks 0-63 (report #3 was next).")
    assert "rank 0: ValueError: bad batch" in message
    assert "ranks 1-63 (the same for each; rank 1's): rank 1: WorkerDied" in message
    assert "ranks 64-69 were still running, here:" in message
    assert len(message.splitlines()) < 15


def test_the_rank_table_of_64_ranks_is_a_few_rows_and_names_the_slow_one() -> None:
    def times(rank: int) -> dict[str, float]:
        slow = rank == 17
        return {"window": 0.1, "data": 0.05 if slow else 0.005, "collective": 0.001 if slow else 0.04, "report": 0.002}

    reports = [{"step_times": {str(rank): times(rank) for rank in range(64)}} for _ in range(6)]
    lines = rank_table(reports)
    assert len(lines) <= 8
    assert any(line.strip().startswith("median of 64") for line in lines)
    assert any(line.strip().startswith("rank 17") for line in lines)
    assert lines[-1] == "slowest: rank 17 — data loading, 50% of its step time"


DESCRIPTORS_SCRIPT = """
import os, resource
from lockstep._internal.descriptors import ensure_descriptors_for, readable_within
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
ensure_descriptors_for(1024)
raised = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
read_end, write_end = os.pipe()
high = os.dup2(read_end, 3000)  # past what select.select can watch
quiet = readable_within(high, 0.05)
os.write(write_end, b"x")
print(raised, hard, quiet, readable_within(high, 1.0))
"""


def test_a_driver_of_1024_ranks_raises_its_open_file_limit_and_waits_on_descriptors_past_1024() -> None:
    out = subprocess.run([sys.executable, "-c", DESCRIPTORS_SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    raised, hard, quiet, readable = out.stdout.split()
    assert int(raised) >= min(int(hard), 1024 * 4), out.stdout
    assert (quiet, readable) == ("False", "True")
