"""Behaviours that must match Ray Train 2.60's, each once wrong here (found in review): the
ranks' data order when one rank iterates more, nested metric names for checkpoint scores, an
iterable dataset under enable_reproducibility, GPU settings refused before start, a backend that
can't start, defaultdict batches, torchrun's GPU per LOCAL_RANK."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lockstep import CheckpointConfig, Result, ScalingConfig
from lockstep._internal.persist.storage import RunStorage
from lockstep._internal.rank.devices import gpu_of_local_rank
from lockstep._internal.rank.torch_devices import move_to_device
from lockstep._internal.run.run_record import RunRecorder
from lockstep.torch import train_loop_utils
from lockstep.torch.data_order import ResumableDataLoader
from lockstep.torch.process_group import describe_start_failure


# -- data order (test_data_order.py)
def rank_loader(rank: int) -> ResumableDataLoader:
    data = list(range(16))
    return ResumableDataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=rank))


def one_pass(loader: ResumableDataLoader) -> list[int]:
    return [int(item) for batch in loader for item in batch]


@pytest.mark.parametrize("sets_the_epoch", [False, True])
def test_one_rank_peeking_at_a_batch_keeps_the_ranks_on_one_epoch(sets_the_epoch: bool) -> None:
    ranks = [rank_loader(0), rank_loader(1)]
    for epoch in range(3):
        if sets_the_epoch:
            for loader in ranks:
                loader.sampler.set_epoch(epoch)
        if epoch == 0:
            next(iter(ranks[0]))  # rank 0 alone looks at a batch first, e.g. to log its shape
        seen = one_pass(ranks[0]) + one_pass(ranks[1])
        assert sorted(seen) == list(range(16)), f"epoch {epoch}: samples given to two ranks, or to none"


def test_a_pass_left_early_starts_its_epoch_over_and_a_whole_one_moves_on() -> None:
    loader = rank_loader(0)
    whole_epoch_0 = one_pass(rank_loader(0))
    first = next(iter(loader))
    assert [int(item) for item in first] == whole_epoch_0[:2]
    assert one_pass(loader) == whole_epoch_0
    assert one_pass(loader) != whole_epoch_0  # epoch 1's order


# -- nested score attribute (test_checkpoint_and_result.py)
def test_a_nested_score_attribute_keeps_the_best_checkpoints(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    storage = RunStorage.for_run(str(tmp_path), "run")
    config = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="val/acc", checkpoint_score_order="max")
    recorder = RunRecorder(storage, config, world_size=1)
    recorder.open()
    for index, accuracy in enumerate([0.9, 0.1, 0.2, 0.3]):
        name = f"checkpoint_{index:06d}"
        Path(storage.checkpoint_path(name)).mkdir()
        recorder.log_report(index, "{}", name)
        recorder.commit_checkpoint(name, index, {"val": {"acc": accuracy}})
    recorder.finish("finished")
    result = Result.from_path(tmp_path / "run")
    assert [metrics["val"]["acc"] for _, metrics in result.best_checkpoints] == [0.3, 0.9]
    assert Path(storage.checkpoint_path("checkpoint_000000")).is_dir(), "the best checkpoint was deleted"
    best = result.get_best_checkpoint("val/acc", "max")
    assert best is not None and best.path.endswith("checkpoint_000000")
    assert not [record for record in caplog.records if "checkpoint_score_attribute" in record.getMessage()]


def test_a_checkpoint_without_the_score_attribute_is_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = RunStorage.for_run(str(tmp_path), "run")
    config = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="acc")
    recorder = RunRecorder(storage, config, world_size=1)
    recorder.open()
    caplog.set_level("WARNING", logger="lockstep")
    for index in range(2):
        name = f"checkpoint_{index:06d}"
        Path(storage.checkpoint_path(name)).mkdir()
        recorder.log_report(index, "{}", name)
        recorder.commit_checkpoint(name, index, {"loss": 1.0})
    told = [record.getMessage() for record in caplog.records if "checkpoint_score_attribute" in record.getMessage()]
    assert len(told) == 1 and "'acc' is not a number among the metrics of checkpoint_000000 (loss)" in told[0]


# -- prepare_data_loader (test_prepare.py)
class Counting(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(6))


def test_reproducibility_leaves_an_iterable_dataset_loader_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(train_loop_utils, "_reproducible_seed", 0)
    loader = DataLoader(Counting(), batch_size=2)
    prepared = train_loop_utils.prepare_data_loader(loader)
    assert [batch.tolist() for batch in prepared] == [[0, 1], [2, 3], [4, 5]]


# -- config (test_config.py)
def test_use_gpu_with_no_gpu_per_worker_is_refused() -> None:
    from lockstep.torch import TorchTrainer

    with pytest.raises(ValueError, match="use_gpu=True.*'GPU': 0"):
        TorchTrainer(print, scaling_config=ScalingConfig(use_gpu=True, resources_per_worker={"CPU": 1, "GPU": 0}))


# -- process group start (test_process_group_start.py)
def test_a_backend_that_cannot_start_is_not_called_a_network_problem() -> None:
    no_mpi = RuntimeError("Distributed package doesn't have MPI built in. MPI is only included if you build PyTorch")
    told = describe_start_failure(1, 2, 120, no_mpi)
    assert told.startswith("rank 1 of 2 could not start its process group: RuntimeError: Distributed package")
    assert "not a network problem" in told and "GLOO_SOCKET_IFNAME" not in told and "120 s" not in told
    timed_out = describe_start_failure(1, 2, 120, TimeoutError("Socket Timeout"))
    assert "within 120 s" in timed_out and "GLOO_SOCKET_IFNAME" in timed_out


# -- devices
def test_a_defaultdict_batch_keeps_its_type_and_default() -> None:
    batch = collections.defaultdict(list, {"x": torch.ones(2)})
    moved = move_to_device(batch, torch.device("cpu"))
    assert isinstance(moved, collections.defaultdict) and moved.default_factory is list
    assert torch.equal(moved["x"], torch.ones(2))


def test_a_torchrun_rank_uses_the_gpu_at_its_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_of_local_rank(1) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert [gpu_of_local_rank(0), gpu_of_local_rank(1)] == ["2", "3"]  # cuda:0 and cuda:1 in this process
    with pytest.raises(ValueError, match="lists 2 GPU"):
        gpu_of_local_rank(2)


def test_an_empty_checkpoint_dir_name_is_the_default_name_as_in_ray() -> None:
    from lockstep._internal.rank.worker_session import _checked_dir_name

    assert _checked_dir_name("", 7) == _checked_dir_name(None, 7) == "checkpoint_000007"
