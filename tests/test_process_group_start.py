"""Joining the process group is bounded by TorchConfig.start_timeout_s, not by the collectives'
30-minute timeout, and a rank that can't join says what it advertised and how to fix it."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import lockstep
from lockstep import RunConfig, ScalingConfig, TrainingFailedError
from lockstep.context import TrainContext
from lockstep.torch import TorchConfig, TorchTrainer


class RankOneNeverJoins(TorchConfig):
    """Rank 1 blocks forever before it would join the process group."""

    def on_worker_start(self, context: TrainContext, use_gpu: bool) -> None:
        if context.world_rank == 1:
            threading.Event().wait()
        super().on_worker_start(context, use_gpu)


def never_reached() -> None:
    lockstep.report({"reached": 1})


@pytest.mark.timeout(90)
def test_a_rank_that_never_joins_fails_the_run_within_the_start_timeout(storage_path: str) -> None:
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as caught:
        TorchTrainer(
            never_reached,
            scaling_config=ScalingConfig(num_workers=2),
            torch_config=RankOneNeverJoins(start_timeout_s=3),
            run_config=RunConfig(storage_path=storage_path, verbose=0),
        ).fit()
    assert time.monotonic() - started < 60, "the start timeout did not bound the wait"
    message = str(caught.value)
    assert "rank 0 of 2 could not join the process group within 3 s" in message
    assert "this rank advertised" in message and "GLOO_SOCKET_IFNAME" in message
    assert "start_timeout_s" in message


def slow_rank_zero_then_all_reduce() -> None:
    if lockstep.get_context().get_world_rank() == 0:
        time.sleep(4)  # longer than the start timeout: collectives must wait by timeout_s instead
    total = torch.ones(1)
    dist.all_reduce(total)
    lockstep.report({"sum": total.item()})


@pytest.mark.timeout(90)
def test_after_the_start_collectives_wait_by_timeout_s(storage_path: str) -> None:
    result = TorchTrainer(
        slow_rank_zero_then_all_reduce,
        scaling_config=ScalingConfig(num_workers=2),
        torch_config=TorchConfig(start_timeout_s=1, timeout_s=120),
        run_config=RunConfig(storage_path=storage_path, verbose=0),
    ).fit()
    assert result.metrics["sum"] == 2.0


def test_start_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="start_timeout_s"):
        TorchConfig(start_timeout_s=0)
