"""Sweeps and stopping: RunConfig(stop=...), callbacks that stop a run (EarlyStopping, Optuna's
PruningCallback), several fits at once from threads of one driver, several driver processes on
one Optuna study, `lockstep plot` of several runs, and the sweep example's smoke test."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

import lockstep
from lockstep import Checkpoint, RunConfig, ScalingConfig
from lockstep.callbacks import Callback, EarlyStopping, RunInfo
from lockstep.torch import TorchTrainer

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def count_down(config: dict[str, Any]) -> dict[str, Any]:
    """Reports ``loss`` from ``config['losses']``, a checkpoint (one file per rank) every
    ``config['every']`` reports; returns what it saw (it never returns when stopped)."""
    context = lockstep.get_context()
    start = lockstep.get_checkpoint()
    first = int(json.loads((Path(start.path) / "state.json").read_text())["next"]) if start else 0
    for step in range(first, len(config["losses"])):
        metrics = {"step": step, "loss": config["losses"][step], "nested": {"acc": step / 10}}
        if (step + 1) % config.get("every", 1) == 0:
            with tempfile.TemporaryDirectory() as folder:
                Path(folder, f"rank{context.get_world_rank()}.txt").write_text(str(step))
                Path(folder, "state.json").write_text(json.dumps({"next": step + 1}))
                lockstep.report(metrics, checkpoint=Checkpoint.from_directory(folder))
        else:
            lockstep.report(metrics)
    return {"ran_to_the_end": True}


def fit(storage_path: str, name: str, losses: list[float], workers: int = 2, every: int = 1,
        **run_config: Any) -> lockstep.Result:
    trainer = TorchTrainer(
        count_down, train_loop_config={"losses": losses, "every": every},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name=name, storage_path=storage_path, verbose=0, **run_config),
    )
    return trainer.fit()


def record_of(storage_path: str, name: str) -> dict[str, Any]:
    return json.loads((Path(storage_path) / name / "lockstep_run.json").read_text())


LOSSES = [1.0, 0.8, 0.6, 0.5, 0.45, 0.44, 0.44, 0.45, 0.46, 0.47]


# -- RunConfig(stop=...) ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_stop_dict_training_iteration_stops_every_rank_at_that_report(storage_path: str) -> None:
    result = fit(storage_path, "iters", LOSSES, stop={"training_iteration": 3})
    assert [row["step"] for row in result.metrics_history] == [0, 1, 2], "stopped after the 3rd report"
    assert result.error is None and result.metrics["step"] == 2
    folder = Path(result.checkpoint.path)
    assert folder.name == "checkpoint_000002" and {"rank0.txt", "rank1.txt"} <= {p.name for p in folder.iterdir()}
    record = record_of(storage_path, "iters")
    assert record["status"] == "stopped" and record["latest_checkpoint"] == "checkpoint_000002"
    assert "training_iteration=3 reached 3" in record["stop_reason"]
    logs = Path(storage_path, "iters", "logs")
    assert "PreemptionStop" not in (logs / "rank_1.log").read_text(), "a stop is not shown as a failure"


@pytest.mark.timeout(60)
def test_stop_dict_on_a_metric_and_a_nested_one(storage_path: str) -> None:
    result = fit(storage_path, "nested", LOSSES, stop={"nested/acc": 0.35, "missing": 1})
    assert result.metrics["step"] == 4, "acc = 0.4 >= 0.35 at step 4"


@pytest.mark.timeout(60)
def test_stop_function_and_async_checkpoint_committed(storage_path: str) -> None:
    seen: list[int] = []

    def below(index: int, metrics: dict[str, Any]) -> bool:
        seen.append(metrics["training_iteration"])
        return metrics["loss"] < 0.55

    result = fit(storage_path, "function", LOSSES, every=2, stop=below)
    assert result.metrics["step"] == 3 and seen == [1, 2, 3, 4]
    assert Path(result.checkpoint.path).name == "checkpoint_000003", "the stop report's checkpoint is committed"
    assert record_of(storage_path, "function")["status"] == "stopped"


@pytest.mark.parametrize("stop", [{"loss": "low"}, {3: 1.0}, {}, ["training_iteration"], 5])
def test_bad_stop_is_a_value_error(stop: Any) -> None:
    with pytest.raises(ValueError, match="RunConfig\\(stop="):
        RunConfig(stop=stop)


# -- callbacks that stop a run ---------------------------------------------------------------------


class StopAt(Callback):
    def __init__(self, index: int) -> None:
        self.index = index
        self.ends: list[str] = []

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        if index == self.index:
            run.request_stop("enough", status="stopped")

    def on_run_end(self, run: RunInfo, status: str, error: Exception | None) -> None:
        self.ends.append(status)


@pytest.mark.timeout(60)
def test_a_callback_stops_the_run_and_hears_the_status(storage_path: str) -> None:
    callback = StopAt(1)
    result = fit(storage_path, "callback", LOSSES, callbacks=[callback])
    assert result.metrics["step"] == 1 and callback.ends == ["stopped"]
    assert record_of(storage_path, "callback")["stop_reason"] == "enough"


@pytest.mark.timeout(60)
def test_early_stopping_waits_patience_reports_without_improvement(storage_path: str) -> None:
    result = fit(storage_path, "early", LOSSES, callbacks=[EarlyStopping("loss", mode="min", patience=2, min_delta=0.02)])
    # best 0.45 at step 4 (0.44 is not 0.02 better): steps 5 and 6 wait, the run stops at 6
    assert result.metrics["step"] == 6
    assert "best 0.45 at report #4" in record_of(storage_path, "early")["stop_reason"]


@pytest.mark.timeout(60)
def test_a_stop_in_local_mode(storage_path: str) -> None:
    result = fit(storage_path, "local_mode", LOSSES, workers=0, stop={"step": 1})
    assert result.metrics["step"] == 1 and record_of(storage_path, "local_mode")["status"] == "stopped"


def test_early_stopping_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="mode"):
        EarlyStopping("loss", mode="lowest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping("loss", patience=0)
    with pytest.raises(ValueError, match="status"):
        RunInfo("r", "/r", 1, "/r/logs").request_stop("why", status="done")  # type: ignore[arg-type]
