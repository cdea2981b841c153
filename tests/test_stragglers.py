"""The slow rank named: the rule on made-up step times, the progress line, and real runs of 2, 3
and 4 workers (a rank slowed in its data loader, a rank slowed in its forward pass, a balanced
run; with 3 and 4 ranks the slow one is neither the first nor the last) read back with
``lockstep show``."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep._internal.output import progress
from lockstep._internal.run.stragglers import SlowRank, rank_table, recent_times, slowest_rank
from lockstep.cli import open_run, run_summary
from lockstep.torch import TorchTrainer, prepare_data_loader, prepare_model

# -- the rule --------------------------------------------------------------------------------------


def times(window: float, data: float = 0.0, collective: float = 0.0, report: float = 0.0) -> dict[str, float]:
    return {"window": window, "data": data, "collective": collective, "report": report}


def history(*per_report: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    return [{"report_index": index, "metrics": {}, "step_times": ranks} for index, ranks in enumerate(per_report)]


def slowest(reports: list[dict[str, Any]]) -> SlowRank | None:
    return slowest_rank(recent_times(reports))


def test_a_rank_waiting_for_data_while_the_others_wait_for_it_is_named() -> None:
    slow_data = {"0": times(1.0, data=0.05, collective=0.6, report=0.05), "1": times(1.0, data=0.7, collective=0.02)}
    slow = slowest(history(*[slow_data] * 6))
    assert slow is not None and (slow.rank, slow.cause) == (1, "data")
    assert slow.describe() == "rank 1 — data loading, 70% of its step time"


def test_the_cause_is_the_share_in_which_the_slow_rank_exceeds_the_others() -> None:
    # rank 1 loads slowly: the others wait for it in the all-reduce; compute is the same on all
    # ranks and the largest share of rank 1's time, but not where it differs
    fast = times(1.0, data=0.01, collective=0.40)
    slow_data = {"0": fast, "1": times(1.0, data=0.40, collective=0.01), "2": fast}
    slow = slowest(history(*[slow_data] * 6))
    assert slow is not None and (slow.rank, slow.cause) == (1, "data"), slow


@pytest.mark.parametrize(("world_size", "slow_rank"), [(3, 1), (4, 2), (4, 1)])
@pytest.mark.parametrize("cause", ["data", "compute"])
def test_a_slow_rank_in_the_middle_of_3_or_4_is_named_for_its_cause(
    world_size: int, slow_rank: int, cause: str
) -> None:
    fast = times(1.0, data=0.05, collective=0.45)
    slow_times = times(1.0, data=0.50, collective=0.02) if cause == "data" else times(1.0, data=0.05, collective=0.02)
    report = {str(rank): (slow_times if rank == slow_rank else fast) for rank in range(world_size)}
    slow = slowest(history(*[report] * 6))
    assert slow is not None and (slow.rank, slow.cause) == (slow_rank, cause), slow


def test_a_rank_computing_longer_is_named_for_compute() -> None:
    slow_compute = {"0": times(1.0, data=0.01, collective=0.55), "1": times(1.0, data=0.01, collective=0.05)}
    slow = slowest(history(*[slow_compute] * 4))
    assert slow is not None and (slow.rank, slow.cause) == (1, "compute")
    assert slow.short() == "rank 1 (compute)"


def test_balanced_ranks_name_nobody() -> None:
    balanced = {"0": times(1.0, data=0.2, collective=0.1, report=0.02), "1": times(1.0, data=0.25, collective=0.05)}
    assert slowest(history(*[balanced] * 6)) is None
    assert "slowest: none" in "\n".join(rank_table(history(*[balanced] * 6)))


def test_a_small_difference_in_a_tight_loop_names_nobody() -> None:
    # rank 1 is twice as busy, but by 2% of the time between reports: jitter, not a straggler
    tight = {"0": times(1.0, collective=0.97), "1": times(1.0, collective=0.95)}
    assert slowest(history(*[tight] * 6)) is None


def test_a_rank_slow_now_and_then_is_not_named() -> None:
    slow_once = {"0": times(1.0, collective=0.6), "1": times(1.0, collective=0.0)}
    balanced = {"0": times(1.0, collective=0.1), "1": times(1.0, collective=0.1)}
    assert slowest(history(balanced, slow_once, balanced, slow_once, balanced, balanced)) is None


def test_too_few_reports_name_nobody_and_only_recent_reports_count() -> None:
    slow = {"0": times(1.0, collective=0.6), "1": times(1.0)}
    balanced = {"0": times(1.0), "1": times(1.0)}
    assert slowest(history(slow, slow)) is None
    assert slowest(history(*[slow] * 10, *[balanced] * 6)) is None
    assert slowest(history(*[balanced] * 10, *[slow] * 6)) == SlowRank(1, "compute", 1.0)


def test_old_records_without_step_times_show_no_table() -> None:
    old = [{"report_index": 0, "metrics": {"loss": 1.0}, "checkpoint_dir_name": None}]
    assert rank_table(old) == [] and slowest(old) is None


def test_the_progress_line_shows_the_slow_rank() -> None:
    line = progress.ProgressCallback("demo", 2, stream=io.StringIO())
    line.on_run_start(None)  # type: ignore[arg-type]
    try:
        progress.note_slow_rank(SlowRank(1, "data", 0.71), "demo")
        assert "| slow: rank 1 (data)" in line.text()
        progress.note_slow_rank(None, "demo")
        assert "slow:" not in line.text()
    finally:
        line.on_run_end(None, "finished", None)  # type: ignore[arg-type]


def test_with_two_fits_the_slow_rank_shows_on_its_own_runs_line() -> None:
    first = progress.ProgressCallback("trial_a", 2, stream=io.StringIO())
    second = progress.ProgressCallback("trial_b", 2, stream=io.StringIO())
    first.on_run_start(None)  # type: ignore[arg-type]
    second.on_run_start(None)  # type: ignore[arg-type]
    try:
        progress.note_slow_rank(SlowRank(1, "data", 0.71), "trial_b")
        assert "slow:" not in first.text() and "| slow: rank 1 (data)" in second.text()
    finally:
        second.on_run_end(None, "finished", None)  # type: ignore[arg-type]
        first.on_run_end(None, "finished", None)  # type: ignore[arg-type]


# -- real runs -------------------------------------------------------------------------------------

STEPS_PER_REPORT, REPORTS, DELAY_S = 4, 8, 0.03


class Samples(Dataset):
    """Small random samples; ``delay_s`` of sleep per sample (the scenario, not a race fix)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        generator = torch.Generator().manual_seed(index)
        return torch.randn(16, generator=generator), torch.randn(1, generator=generator)


class Net(torch.nn.Module):
    """A small regression model whose forward sleeps ``delay_s`` (the scenario)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.layers = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.layers(x)


def train_func(config: dict[str, Any]) -> None:
    rank = lockstep.get_context().get_world_rank()
    slow = rank == config["slow_rank"]
    per_sample = config["data_delay_s"] / 2 if slow or config["everyone"] else 0.0
    loader = prepare_data_loader(DataLoader(Samples(per_sample), batch_size=2, shuffle=True))
    model = prepare_model(Net(config["forward_delay_s"] if slow or config["everyone"] else 0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = iter(loader)
    for _ in range(REPORTS):
        for _ in range(STEPS_PER_REPORT):
            x, y = next(batches)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        lockstep.report({"loss": loss.item()})


def run(storage_path: str, name: str, num_workers: int = 2, **config: Any) -> str:
    settings = {"slow_rank": 1, "data_delay_s": 0.0, "forward_delay_s": 0.0, "everyone": False, **config}
    TorchTrainer(
        train_func,
        train_loop_config=settings,
        scaling_config=ScalingConfig(num_workers=num_workers),
        run_config=RunConfig(name=name, storage_path=storage_path, verbose=0),
    ).fit()
    return run_summary(open_run(name, storage_path))


def recorded_step_times(storage_path: str, name: str) -> list[dict[str, Any]]:
    lines = (Path(storage_path) / name / "reports.jsonl").read_text().splitlines()
    return [json.loads(line)["step_times"] for line in lines]


@pytest.mark.timeout(90)
def test_a_rank_slowed_in_its_data_loader_is_named(storage_path: str) -> None:
    shown = run(storage_path, "slow_data", data_delay_s=DELAY_S)
    assert "slowest: rank 1 — data loading" in shown, shown
    step_times = recorded_step_times(storage_path, "slow_data")
    assert len(step_times) == REPORTS and all(set(ranks) == {"0", "1"} for ranks in step_times)
    assert "step_times" not in lockstep.Result.from_path(Path(storage_path) / "slow_data").metrics_dataframe
    # the fast rank waited for rank 1 in the gradient all-reduce (timed by prepare_model's hook)
    assert sum(ranks["0"]["collective"] for ranks in step_times[2:]) > 0.5 * STEPS_PER_REPORT * DELAY_S * (REPORTS - 2)


@pytest.mark.timeout(90)
def test_a_rank_slowed_in_its_forward_pass_is_named(storage_path: str) -> None:
    shown = run(storage_path, "slow_forward", forward_delay_s=DELAY_S)
    assert "slowest: rank 1 — compute" in shown, shown


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("num_workers", "slow_rank"), [(3, 1), (4, 2)])
@pytest.mark.parametrize(("cause", "shown_cause"), [("data", "data loading"), ("forward", "compute")])
def test_a_slow_rank_that_is_neither_first_nor_last_is_named(
    storage_path: str, num_workers: int, slow_rank: int, cause: str, shown_cause: str
) -> None:
    shown = run(
        storage_path,
        f"slow_{cause}_{num_workers}",
        num_workers=num_workers,
        slow_rank=slow_rank,
        **{f"{cause}_delay_s": DELAY_S},
    )
    assert f"slowest: rank {slow_rank} — {shown_cause}" in shown, shown
    step_times = recorded_step_times(storage_path, f"slow_{cause}_{num_workers}")
    assert all(set(ranks) == {str(rank) for rank in range(num_workers)} for ranks in step_times)


@pytest.mark.timeout(90)
def test_a_balanced_run_names_nobody(storage_path: str) -> None:
    shown = run(storage_path, "balanced", data_delay_s=DELAY_S / 2, forward_delay_s=DELAY_S / 2, everyone=True)
    assert "slowest: none" in shown, shown
    assert "RANK" in shown and "COMPUTE" in shown


def own_hook_train_func(config: dict[str, Any]) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = prepare_model(Net(0.0))
    model.register_comm_hook(None, allreduce_hook)  # the user's own hook still registers
    loss = model(torch.randn(4, 16)).sum()
    loss.backward()
    lockstep.report({"loss": loss.item(), "hooks": len(model._comm_hooks)})


@pytest.mark.timeout(90)
def test_a_users_own_comm_hook_replaces_the_timing_hook(storage_path: str) -> None:
    result = TorchTrainer(
        own_hook_train_func,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="own_hook", storage_path=storage_path, verbose=0),
    ).fit()
    assert result.metrics is not None and result.metrics["hooks"] == 1
