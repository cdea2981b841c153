"""Hugging Face Transformers and Accelerate in lockstep workers: a tiny randomly initialised BERT
(built from a config, nothing downloaded) trained by ``transformers.Trainer`` on 2 CPU workers,
reported through ``lockstep.huggingface.transformers.RayTrainReportCallback``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # workers inherit it: nothing may be downloaded
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from conftest import REPO_ROOT  # noqa: E402

import lockstep  # noqa: E402
from lockstep import RunConfig, ScalingConfig  # noqa: E402
from lockstep._internal.rank.rank_env import RankEnv  # noqa: E402
from lockstep.huggingface.transformers import (  # noqa: E402
    RayTrainReportCallback,
    batch_loader,
    is_batch_iterable,
    merged_logs,
    prepare_trainer,
)
from lockstep.torch import TorchTrainer  # noqa: E402

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 100, 8
EVAL_STEPS, SAVE_STEPS, MAX_STEPS = 5, 10, 20


class RandomTokens(torch.utils.data.Dataset):
    """``size`` sequences of random token ids with a label that depends on the first token."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, VOCAB, (size, SEQ), generator=generator)
        self.labels = (self.input_ids[:, 0] < VOCAB // 2).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": torch.ones(SEQ, dtype=torch.long),
            "labels": self.labels[index],
        }


def tiny_bert() -> Any:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def training_args(output_dir: str) -> Any:
    return transformers.TrainingArguments(
        output_dir=output_dir,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        eval_strategy="steps",
        eval_steps=EVAL_STEPS,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        logging_steps=EVAL_STEPS,
        learning_rate=1e-3,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


def train_with_trainer(config: dict[str, Any]) -> dict[str, Any]:
    trainer = transformers.Trainer(
        model=tiny_bert(),
        args=training_args(config["output_dir"]),
        train_dataset=RandomTokens(64, seed=1),
        eval_dataset=RandomTokens(16, seed=2),
    )
    trainer.add_callback(RayTrainReportCallback(report_on=config["report_on"]))
    trainer = prepare_trainer(trainer)
    trainer.train()
    weights = trainer.model.classifier.weight.detach()
    mine = {
        "world_size": trainer.args.world_size,
        "process_index": trainer.args.process_index,
        "wrapped": type(trainer.model_wrapped).__name__,
        "classifier_sum": float(weights.abs().sum()),
        "rank": lockstep.get_context().get_world_rank(),
    }
    everyone: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def fit_trainer(tmp_path: Path, report_on: str) -> lockstep.Result:
    return TorchTrainer(
        train_with_trainer,
        train_loop_config={"output_dir": str(tmp_path / "hf_output"), "report_on": report_on},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=f"hf_{report_on}", storage_path=str(tmp_path / "results")),
    ).fit()


def check_save_report(report: dict[str, Any], result: lockstep.Result, step: int) -> Path:
    """A save report carries the merged logs and a checkpoint holding the Trainer's files."""
    assert report["step"] == step and report["checkpoint_dir_name"] is not None
    for key in ("loss", "learning_rate", "grad_norm", "eval_loss", "epoch"):
        assert key in report, f"{key} missing from the save report {report}"
    folder = Path(result.path, report["checkpoint_dir_name"], RayTrainReportCallback.CHECKPOINT_NAME)
    names = {path.name for path in folder.iterdir()}
    assert {"config.json", "model.safetensors", "trainer_state.json", "optimizer.pt"} <= names, names
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= names, f"each rank's RNG state should be there: {names}"
    return folder


@pytest.mark.timeout(180)
def test_report_at_saves_with_merged_logs_and_loadable_checkpoint(tmp_path: Path) -> None:
    result = fit_trainer(tmp_path, report_on="save")
    history = result.metrics_history
    assert [report["step"] for report in history] == [SAVE_STEPS, MAX_STEPS]
    check_save_report(history[0], result, SAVE_STEPS)
    last = check_save_report(history[1], result, MAX_STEPS)
    assert history[1]["eval_loss"] != history[0]["eval_loss"]  # the latest value, not the first
    assert Path(result.checkpoint.path, "checkpoint") == last

    ranks = result.return_value
    assert [seen["rank"] for seen in ranks] == [seen["process_index"] for seen in ranks] == [0, 1]
    for seen in ranks:
        assert seen["world_size"] == 2 and seen["wrapped"] == "DistributedDataParallel"
    assert ranks[0]["classifier_sum"] == ranks[1]["classifier_sum"]  # DDP kept the replicas equal
    loaded = transformers.BertForSequenceClassification.from_pretrained(str(last))
    assert float(loaded.classifier.weight.detach().abs().sum()) == pytest.approx(ranks[0]["classifier_sum"], rel=1e-6)


@pytest.mark.timeout(180)
def test_report_on_evaluate_adds_a_report_at_every_evaluation(tmp_path: Path) -> None:
    result = fit_trainer(tmp_path, report_on="evaluate")
    history = result.metrics_history
    assert [report["step"] for report in history] == [5, 10, 15, 20]
    assert [report["checkpoint_dir_name"] is not None for report in history] == [False, True, False, True]
    eval_losses = [report["eval_loss"] for report in history]
    assert len(set(eval_losses)) == 4, f"every report should carry that step's evaluation: {eval_losses}"
    for report, step in zip(history[1::2], (SAVE_STEPS, MAX_STEPS), strict=True):
        check_save_report(report, result, step)


@pytest.mark.timeout(180)
def test_report_on_log_reports_every_log_event(tmp_path: Path) -> None:
    result = fit_trainer(tmp_path, report_on="log")
    steps = [(report["step"], report["checkpoint_dir_name"] is not None) for report in result.metrics_history]

    def per_eval(step: int) -> list[tuple[int, bool]]:
        return [(step, False), (step, False)]  # the training-loss log, then the evaluation's

    expected = [*per_eval(5), *per_eval(10), (10, True), *per_eval(15), *per_eval(20), (20, True), (20, False)]
    assert steps == expected
    assert "train_runtime" in result.metrics  # the end-of-training summary is the last report


def use_accelerate() -> dict[str, Any]:
    from accelerate import Accelerator

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(torch.nn.Linear(4, 2), torch.optim.SGD(torch.nn.Linear(4, 2).parameters()))
    gathered = accelerator.gather(torch.tensor([accelerator.process_index]))
    context = lockstep.get_context()
    return {
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "local_process_index": accelerator.local_process_index,
        "world_rank": context.get_world_rank(),
        "world_size": context.get_world_size(),
        "local_rank": context.get_local_rank(),
        "device": str(accelerator.device),
        "lockstep_device": str(lockstep.torch.get_device()),
        "model": type(model).__name__,
        "gathered": gathered.tolist(),
        "same_group": accelerator.state.backend == torch.distributed.get_backend(),
    }


@pytest.mark.timeout(90)
def test_accelerate_sees_lockstep_process_group_and_devices(tmp_path: Path) -> None:
    result = TorchTrainer(
        use_accelerate, scaling_config=ScalingConfig(num_workers=2), run_config=RunConfig(storage_path=str(tmp_path))
    ).fit()
    seen = result.return_value
    assert seen["num_processes"] == seen["world_size"] == 2
    assert seen["process_index"] == seen["world_rank"] == 0 and seen["local_process_index"] == seen["local_rank"]
    assert seen["model"] == "DistributedDataParallel"
    assert seen["gathered"] == [0, 1] and seen["same_group"]
    assert torch.device(seen["device"]).type == torch.device(seen["lockstep_device"]).type == "cpu"


def test_rank_env_tells_accelerate_the_device() -> None:
    cpu_rank = RankEnv(
        world_rank=1,
        world_size=2,
        local_rank=1,
        local_world_size=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=1234,
    )
    assert cpu_rank.variables()["ACCELERATE_USE_CPU"] == "true"
    gpu_rank = dataclasses.replace(cpu_rank, visible_gpus=("4", "6"), gpu_ids=("6",))
    variables = gpu_rank.variables()
    assert variables["ACCELERATE_TORCH_DEVICE"] == "cuda:1" and "ACCELERATE_USE_CPU" not in variables


def test_report_on_is_checked() -> None:
    with pytest.raises(ValueError, match="report_on='epoch'.*'save', 'evaluate', 'log'"):
        RayTrainReportCallback(report_on="epoch")  # type: ignore[arg-type]


def test_batch_iterables_pass_through_and_datasets_do_not() -> None:
    batches = [{"x": torch.arange(3)}, {"x": torch.arange(3, 5)}]

    def again() -> Any:
        return iter(batches)

    class Reiterable:
        def __iter__(self) -> Any:
            return again()

    assert is_batch_iterable(Reiterable()) and is_batch_iterable(again())
    assert not is_batch_iterable(RandomTokens(4, seed=0)) and not is_batch_iterable(batches)
    assert not is_batch_iterable({"a": 1}) and not is_batch_iterable(None)
    loaded = list(batch_loader(Reiterable()))
    assert [batch["x"].tolist() for batch in loaded] == [[0, 1, 2], [3, 4]]
    assert [batch["x"].tolist() for batch in batch_loader(Reiterable())] == [[0, 1, 2], [3, 4]]


def test_merged_logs_keep_the_latest_value() -> None:
    state = transformers.TrainerState()
    state.log_history = [{"loss": 2.0, "step": 5}, {"eval_loss": 1.5, "step": 5}, {"loss": 1.0, "step": 10}]
    assert merged_logs(state) == {"loss": 1.0, "eval_loss": 1.5, "step": 10}


def test_prepare_trainer_rejects_other_objects() -> None:
    with pytest.raises(TypeError, match="transformers.Trainer"):
        prepare_trainer(object())  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_example_runs_offline(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "examples" / "transformers_text_classification.py"),
            "--smoke-test",
            "--num-workers",
            "2",
            "--storage-path",
            str(tmp_path / "results"),
            "--name",
            "example",
            "--output-dir",
            str(tmp_path / "hf_output"),
        ],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert completed.returncode == 0, f"exit {completed.returncode}\n{completed.stdout}\n{completed.stderr}"
    assert "Best checkpoint: " in completed.stdout and "Last result: eval_accuracy=" in completed.stdout
    reports = lockstep.Result.from_path(tmp_path / "results" / "example").metrics_history
    assert [report["step"] for report in reports] == [10, 20, 30, 40]
    assert all(0.3 < report["loss"] < 1.0 for report in reports), reports  # a per-worker mean, not scaled


def train_on_ray_data_batches(config: dict[str, Any]) -> dict[str, Any]:
    train_batches = lockstep.get_dataset_shard("train").iter_torch_batches(batch_size=4)
    eval_batches = lockstep.get_dataset_shard("eval").iter_torch_batches(batch_size=8)
    args = transformers.TrainingArguments(
        output_dir=config["output_dir"],
        max_steps=6,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=6,
        logging_steps=3,
        report_to="none",
        disable_tqdm=True,
        per_device_train_batch_size=2,  # what the Trainer would re-batch to without prepare_trainer
    )
    trainer = transformers.Trainer(model=tiny_bert(), args=args, train_dataset=train_batches, eval_dataset=eval_batches)
    trainer.add_callback(RayTrainReportCallback(report_on="evaluate"))
    trainer = prepare_trainer(trainer)
    sizes = [len(batch["labels"]) for batch in trainer.get_train_dataloader()]
    trainer.train()
    return {"batch_sizes": sizes, "global_step": trainer.state.global_step, "world_size": trainer.args.world_size}


@pytest.mark.timeout(240)
def test_prepare_trainer_takes_ray_data_batches_on_the_ray_executor(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    import numpy as np

    def rows(size: int, seed: int) -> list[dict[str, Any]]:
        data = RandomTokens(size, seed)
        return [
            {
                "input_ids": data.input_ids[i].numpy(),
                "attention_mask": np.ones(SEQ, dtype=np.int64),
                "labels": int(data.labels[i]),
            }
            for i in range(size)
        ]

    tag = os.environ.pop("LOCKSTEP_TEST_TAG")  # Ray's processes outlive the test's check; shut down below
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        os.environ["LOCKSTEP_TEST_TAG"] = tag
    try:
        datasets = {"train": ray.data.from_items(rows(64, 1)), "eval": ray.data.from_items(rows(16, 2))}
        result = TorchTrainer(
            train_on_ray_data_batches,
            train_loop_config={"output_dir": str(tmp_path / "hf_output")},
            datasets=datasets,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=str(tmp_path / "results")),
        ).fit()
    finally:
        ray.shutdown()
    seen = result.return_value
    assert seen["batch_sizes"] == [4] * 8, "each rank's 32 rows, in the shard's own batches of 4"
    assert seen["global_step"] == 6 and seen["world_size"] == 2
    assert [(report["step"], report["checkpoint_dir_name"] is not None) for report in result.metrics_history] == [
        (3, False),
        (6, True),
    ]
    assert "eval_loss" in result.metrics_history[0]
