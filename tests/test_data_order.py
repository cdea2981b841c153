"""Exact data order of prepared loaders: epochs without set_epoch, and resuming mid-epoch,
in one process and in real 2-worker runs with a failure and a restart."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lockstep
from lockstep import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from lockstep.torch import TorchTrainer, prepare_data_loader
from lockstep.torch.data_order import EpochTrackingSampler, ResumableDataLoader

SAMPLES, BATCH = 40, 3


def reference_order(epoch: int, rank: int = 0, samples: int = SAMPLES, shuffle: bool = True) -> list[int]:
    """What a DistributedSampler with set_epoch(epoch) gives this rank of 2."""
    sampler = DistributedSampler(list(range(samples)), num_replicas=2, rank=rank, shuffle=shuffle, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def loader_for(rank: int = 0, **settings: object) -> ResumableDataLoader:
    """A resumable loader as prepare_data_loader builds it for ``rank`` of 2."""
    dataset = list(range(SAMPLES))
    sampler = EpochTrackingSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
    settings.setdefault("batch_size", BATCH)
    return ResumableDataLoader(dataset, sampler=sampler, **settings)


def saved_position(epoch: int, batches: int, num_replicas: int = 2) -> dict[str, object]:
    """A state_dict() as a loader of ``num_replicas`` workers saves it mid-epoch."""
    return {
        "epoch": epoch,
        "batches_yielded": batches,
        "pass_finished": False,
        "num_replicas": num_replicas,
        "batch_size": BATCH,
    }


def one_pass(loader: object) -> list[int]:
    return [int(item) for batch in loader for item in torch.as_tensor(batch).reshape(-1)]


def first_batches(loader: object, count: int) -> list[int]:
    batches = iter(loader)
    return [int(item) for _ in range(count) for item in next(batches).reshape(-1)]


# -- one process ---------------------------------------------------------------------------------


def test_each_pass_without_set_epoch_is_the_next_epoch() -> None:
    loader = loader_for()
    passes = [one_pass(loader) for _ in range(3)]
    assert passes == [reference_order(epoch) for epoch in range(3)]
    assert len({tuple(order) for order in passes}) == 3


def test_set_epoch_chooses_the_epoch_exactly() -> None:
    loader = loader_for()
    orders = []
    for epoch in (0, 1, 1, 5):
        loader.sampler.set_epoch(epoch)
        orders.append(one_pass(loader))
    orders.append(one_pass(loader))  # no set_epoch: the one after the last
    assert orders == [reference_order(epoch) for epoch in (0, 1, 1, 5, 6)]


def test_callers_own_distributed_sampler_advances_too() -> None:
    dataset = list(range(SAMPLES))
    own = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=0)
    loader = prepare_data_loader(DataLoader(dataset, batch_size=BATCH, sampler=own))
    assert isinstance(loader, ResumableDataLoader) and loader.sampler is own
    assert [one_pass(loader) for _ in range(2)] == [reference_order(epoch, rank=1) for epoch in range(2)]
    own.set_epoch(7)
    assert one_pass(loader) == reference_order(7, rank=1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("num_workers", "persistent", "drop_last"), [(0, False, False), (2, False, True), (2, True, False)]
)
@pytest.mark.parametrize("rank", [0, 1])
def test_state_dict_resumes_mid_epoch_exactly(rank: int, num_workers: int, persistent: bool, drop_last: bool) -> None:
    settings = {"num_workers": num_workers, "persistent_workers": persistent, "drop_last": drop_last}
    loader = loader_for(rank, **settings)
    one_pass(loader)
    seen = first_batches(loader, 4)
    state = loader.state_dict()
    assert state["epoch"] == 1 and state["batches_yielded"] == 4 and not state["pass_finished"]
    restarted = loader_for(rank, **settings)
    restarted.load_state_dict(json.loads(json.dumps(state)))
    assert restarted.state_dict() == state, "a loaded position is saved again as it is until the next pass"
    rest = one_pass(restarted)
    expected = reference_order(1, rank)[: len(reference_order(1, rank)) // BATCH * BATCH if drop_last else None]
    assert seen + rest == expected
    assert one_pass(restarted) == reference_order(2, rank)[: len(expected)]


class CountingDataset(Dataset):
    """Numbers that note which of them were loaded."""

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        self.loaded.append(index)
        return index


def test_skipped_batches_are_never_loaded() -> None:
    dataset = CountingDataset()
    sampler = EpochTrackingSampler(dataset, num_replicas=2, rank=0, seed=0)
    loader = ResumableDataLoader(dataset, sampler=sampler, batch_size=BATCH)
    loader.load_state_dict(saved_position(epoch=2, batches=5))
    rest = one_pass(loader)
    assert rest == reference_order(2)[5 * BATCH :]
    assert dataset.loaded == rest


def test_unbatched_loader_resumes_by_sample() -> None:
    loader = loader_for(batch_size=None)
    samples = iter(loader)
    seen = [int(next(samples)) for _ in range(3)]
    restarted = loader_for(batch_size=None)
    restarted.load_state_dict(loader.state_dict())
    assert seen + [int(item) for item in restarted] == reference_order(0)


def test_a_finished_pass_resumes_at_the_next_epoch() -> None:
    loader = loader_for()
    one_pass(loader)
    state = loader.state_dict()
    assert state["pass_finished"] and state["epoch"] == 0
    restarted = loader_for()
    restarted.load_state_dict(state)
    assert one_pass(restarted) == reference_order(1)


def test_set_epoch_after_loading(caplog: pytest.LogCaptureFixture) -> None:
    loader = loader_for()
    loader.sampler.set_epoch(3)
    seen = first_batches(loader, 2)
    same = loader_for()
    same.load_state_dict(loader.state_dict())
    same.sampler.set_epoch(3)  # a loop that sets the saved epoch again resumes inside it
    assert seen + one_pass(same) == reference_order(3)
    other = loader_for()
    other.load_state_dict(loader.state_dict())
    other.sampler.set_epoch(4)
    with caplog.at_level(logging.WARNING):
        assert one_pass(other) == reference_order(4)
    assert "restored position is in epoch 3" in caplog.text


def test_other_world_size_restarts_the_epoch(caplog: pytest.LogCaptureFixture) -> None:
    loader = loader_for()
    with caplog.at_level(logging.WARNING):
        loader.load_state_dict(saved_position(epoch=2, batches=5, num_replicas=4))
    assert one_pass(loader) == reference_order(2)
    assert "saved position is for 4 workers" in caplog.text


def test_load_state_dict_says_what_it_wants() -> None:
    with pytest.raises(ValueError, match="state_dict"):
        loader_for().load_state_dict({"epoch": 1})


def test_held_back_batch_is_not_counted_as_seen() -> None:
    loader = loader_for()
    first_batches(loader, 3)
    assert loader.state_dict(held_back=1)["batches_yielded"] == 2


# -- real runs -----------------------------------------------------------------------------------

RUN_SAMPLES, RUN_BATCH, EPOCHS = 48, 4, 2  # 6 batches per rank and epoch


def run_loader() -> ResumableDataLoader:
    """What a train function prepares: a shuffling loader with two loader worker processes."""
    dataset = list(range(RUN_SAMPLES))
    return prepare_data_loader(DataLoader(dataset, batch_size=RUN_BATCH, shuffle=True, num_workers=2))


def passes_without_set_epoch() -> list[object]:
    loader = run_loader()
    mine = [[int(item) for batch in loader for item in batch] for _ in range(3)]
    gathered: list[object] = [None] * 2
    dist.all_gather_object(gathered, mine)
    return gathered


@pytest.mark.timeout(120)
def test_two_workers_see_a_new_epoch_each_pass(storage_path: str) -> None:
    result = TorchTrainer(
        passes_without_set_epoch,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="epochs", storage_path=storage_path),
    ).fit()
    for rank, passes in enumerate(result.return_value):
        assert passes == [reference_order(epoch, rank, RUN_SAMPLES) for epoch in range(3)]
    for epoch in range(3):
        assert sorted(result.return_value[0][epoch] + result.return_value[1][epoch]) == list(range(RUN_SAMPLES))


def _restore(rank: int, loader: ResumableDataLoader) -> tuple[int, dict[str, list[int]]]:
    """(epoch to start at, the sample ids seen per epoch) from the checkpoint, if any."""
    checkpoint = lockstep.get_checkpoint()
    if checkpoint is None:
        return 0, {}
    with checkpoint.as_directory() as folder:
        saved = json.loads(Path(folder, f"rank{rank}.json").read_text())
    loader.load_state_dict(saved["loader"])
    return saved["epoch"], saved["seen"]


def _report(rank: int, epoch: int, loader: ResumableDataLoader, seen: dict[str, list[int]]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        state = {"epoch": epoch, "seen": seen, "loader": loader.state_dict()}
        Path(folder, f"rank{rank}.json").write_text(json.dumps(state))
        lockstep.report(
            {"epoch": epoch, "position": state["loader"]["batches_yielded"]},
            checkpoint=Checkpoint.from_directory(folder),
        )


def train_and_fail_mid_epoch(config: dict) -> None:
    rank = lockstep.get_context().get_world_rank()
    attempt = "second" if Path(config["marker"]).exists() else "first"
    loader = run_loader()
    start, seen = _restore(rank, loader)
    log = Path(config["logs"], f"{attempt}_rank{rank}.jsonl")
    for epoch in range(start, EPOCHS):  # no set_epoch: the loader moves on by itself
        for batch in loader:
            ids = [int(item) for item in batch]
            position = loader.state_dict()["batches_yielded"]
            with log.open("a") as handle:
                handle.write(json.dumps({"epoch": loader.sampler.epoch, "ids": ids}) + "\n")
            seen.setdefault(str(epoch), []).extend(ids)
            if attempt == "first" and rank == 1 and epoch == 1 and position == 3:
                Path(config["marker"]).write_text("failed once")
                os._exit(3)  # one batch after the checkpoint at position 2
            if position % 2 == 0:
                _report(rank, epoch, loader, seen)


@pytest.mark.timeout(180)
def test_restart_mid_epoch_sees_each_sample_once(storage_path: str, tmp_path: Path) -> None:
    result = TorchTrainer(
        train_and_fail_mid_epoch,
        train_loop_config={"marker": str(tmp_path / "marker"), "logs": str(tmp_path)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="resume", storage_path=storage_path, failure_config=FailureConfig(max_failures=1)),
    ).fit()
    assert result.num_failures == 1
    for rank in range(2):
        saved = json.loads(Path(result.checkpoint.path, f"rank{rank}.json").read_text())
        for epoch in range(EPOCHS):
            assert saved["seen"][str(epoch)] == reference_order(epoch, rank, RUN_SAMPLES), (rank, epoch)
        second = [json.loads(line) for line in (tmp_path / f"second_rank{rank}.jsonl").read_text().splitlines()]
        assert [entry["epoch"] for entry in second] == [1] * 4, "the second attempt starts inside epoch 1"
        second_ids = [i for entry in second for i in entry["ids"]]
        assert second_ids == reference_order(1, rank, RUN_SAMPLES)[2 * RUN_BATCH :]
    first_rank1 = (tmp_path / "first_rank1.jsonl").read_text().splitlines()
    assert len(first_rank1) == 6 + 3, "rank 1 saw one batch past its last checkpoint before failing"
    saved = [json.loads(Path(result.checkpoint.path, f"rank{rank}.json").read_text()) for rank in range(2)]
    assert sorted(saved[0]["seen"]["1"] + saved[1]["seen"]["1"]) == list(range(RUN_SAMPLES))
