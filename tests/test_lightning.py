"""lockstep.lightning with both Lightning packages: Ray Train's "Get Started with PyTorch
Lightning" shape on 2 CPU workers (DDP over lockstep's gloo group, a validation loop, top-k
checkpoints by a validation metric, the model reloaded with ``load_from_checkpoint``), the
package choice, and the errors users can run into.

This module imports neither Lightning package at top level: workers import it to find the train
function, and each worker must see only the package its train function uses.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from validation_fns import validate_lightning_checkpoint

import lockstep
from lockstep import CheckpointConfig, RunConfig, ScalingConfig, ValidationConfig, ValidationTaskConfig
from lockstep.lightning import (
    RayDDPStrategy,
    RayDeepSpeedStrategy,
    RayFSDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)
from lockstep.lightning._package import LIGHTNING, PYTORCH_LIGHTNING, choose_package
from lockstep.torch import TorchTrainer

REPO_ROOT = Path(__file__).resolve().parent.parent
TRAINER_MODULES = {LIGHTNING: "lightning.pytorch", PYTORCH_LIGHTNING: "pytorch_lightning"}
FEATURES, CLASSES = 8, 3
TRAIN_BATCHES, EPOCHS = 4, 3
STRATEGIES = {"ddp": RayDDPStrategy, "fsdp": RayFSDPStrategy}


@functools.cache
def lit_model_class(package: str) -> type:
    """A small classifier for ``package``'s Trainer; it records what DDP looked like from inside."""
    pl = importlib.import_module(TRAINER_MODULES[package])

    class LitModel(pl.LightningModule):
        def __init__(self, hidden: int = 16) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES)
            )
            self.seen: dict[str, Any] = {"first_batch_sums": []}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if batch_idx == 0:
                self.seen["first_batch_sums"].append(float(x.sum()))
                self.seen["world"] = (self.trainer.world_size, self.global_rank, self.local_rank)
            loss = torch.nn.functional.cross_entropy(self(x), y)
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            logits = self(x)
            self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
            self.log("val_accuracy", (logits.argmax(1) == y).float().mean(), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return LitModel


def toy_data(count: int, seed: int) -> torch.utils.data.TensorDataset:
    """A learnable 3-class problem on random inputs."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, FEATURES, generator=generator)
    y = (x[:, 0] > 0.5).long() + (x[:, 1] > 0.5).long()
    return torch.utils.data.TensorDataset(x, y)


def lightning_train_func(config: dict[str, Any]) -> dict[str, Any]:
    """Ray's guide's train function: a Trainer with lockstep's strategy, environment and callback."""
    pl = importlib.import_module(TRAINER_MODULES[config["package"]])
    model = lit_model_class(config["package"])()
    loader = torch.utils.data.DataLoader(toy_data(512, seed=0), batch_size=16, shuffle=True)
    val_loader = torch.utils.data.DataLoader(toy_data(128, seed=1), batch_size=32)
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        limit_train_batches=TRAIN_BATCHES,
        limit_val_batches=2,
        devices="auto",
        accelerator="auto",
        strategy=STRATEGIES[config.get("strategy", "ddp")](),
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback(validation=config.get("validation", False))],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=config["root"],
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(model, train_dataloaders=loader, val_dataloaders=val_loader)
    return _gathered_view(pl, trainer, model)


def _gathered_view(pl: Any, trainer: Any, model: Any) -> dict[str, Any]:
    """What each rank saw, gathered to every rank (rank 0's return value is the run's)."""
    mine = {
        **model.seen,
        "params": [p.detach().clone() for p in model.parameters()],
        "strategy_is_package_ddp": isinstance(trainer.strategy, pl.strategies.DDPStrategy),
        "callback_is_package_callback": all(isinstance(cb, pl.Callback) for cb in trainer.callbacks),
        "trainer_module": type(trainer).__module__,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": str(trainer.strategy.root_device),
    }
    if not dist.is_initialized():  # a single worker, whose group Lightning made and removed
        return {"ranks": [mine]}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("package", [LIGHTNING, PYTORCH_LIGHTNING])
def test_ray_getting_started_shape(package: str, storage_path: str, tmp_path: Path) -> None:
    validates = package == LIGHTNING  # RayTrainReportCallback(validation=True): once is enough
    result = TorchTrainer(
        lightning_train_func,
        train_loop_config={"package": package, "root": str(tmp_path / "lightning_root"), "validation": validates},
        validation_config=ValidationConfig(
            validate_lightning_checkpoint, ValidationTaskConfig({"name": RayTrainReportCallback.CHECKPOINT_NAME})
        )
        if validates
        else None,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="lit",
            storage_path=storage_path,
            checkpoint_config=CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="val_accuracy", checkpoint_score_order="max"
            ),
        ),
    ).fit()
    assert result.error is None
    ranks = result.return_value["ranks"]
    _check_ddp_ran_on_two_ranks(ranks, package)
    _check_reports(result)
    _check_top_k(result, storage_path)
    _check_reload(result, package, final_params=ranks[0]["params"])
    if validates:
        _check_validated(result)


def _check_ddp_ran_on_two_ranks(ranks: list[dict[str, Any]], package: str) -> None:
    assert [rank["world"] for rank in ranks] == [(2, 0, 0), (2, 1, 1)]
    assert all(rank["strategy_is_package_ddp"] and rank["callback_is_package_callback"] for rank in ranks)
    assert {rank["trainer_module"].split(".")[0] for rank in ranks} == {package.split(".")[0]}
    assert all(rank["backend"] == "gloo" and rank["device"] == "cpu" for rank in ranks)
    # each rank trained on its own part of the data (a distributed sampler per lockstep worker) ...
    assert ranks[0]["first_batch_sums"] != ranks[1]["first_batch_sums"]
    # ... and DDP averaged the gradients, so the models are still the same
    for mine, theirs in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(mine, theirs)


def _check_reports(result: lockstep.Result) -> None:
    history = result.metrics_history
    assert [report["epoch"] for report in history] == list(range(EPOCHS))
    assert [report["step"] for report in history] == [TRAIN_BATCHES * (epoch + 1) for epoch in range(EPOCHS)]
    assert {"val_loss", "val_accuracy", "train_loss"} <= set(result.metrics)
    assert all(isinstance(report["val_accuracy"], float) for report in history)


def _check_top_k(result: lockstep.Result, storage_path: str) -> None:
    history = result.metrics_history
    kept = sorted(metrics["val_accuracy"] for _, metrics in result.best_checkpoints)
    assert kept == sorted(report["val_accuracy"] for report in history)[-2:]
    folders = sorted(path.name for path in (Path(storage_path) / "lit").glob("checkpoint_*"))
    assert len(folders) == 2
    for checkpoint, _ in result.best_checkpoints:
        assert os.listdir(checkpoint.path) == [RayTrainReportCallback.CHECKPOINT_NAME]


def _check_validated(result: lockstep.Result) -> None:
    """Each kept checkpoint was validated on its own file: the validation read back its epoch."""
    record = json.loads(Path(result.path, "lockstep_run.json").read_text())
    for entry in record["checkpoints"]:
        assert entry["validation"] == "VALIDATED"
        metrics = entry["metrics"]
        assert (metrics["ckpt_epoch"], metrics["ckpt_step"]) == (metrics["epoch"], metrics["step"])


def _check_reload(result: lockstep.Result, package: str, final_params: list[torch.Tensor]) -> None:
    lit_model = lit_model_class(package)
    with result.checkpoint.as_directory() as folder:
        model = lit_model.load_from_checkpoint(os.path.join(folder, RayTrainReportCallback.CHECKPOINT_NAME))
    assert model.hparams.hidden == 16
    for loaded, trained in zip(model.parameters(), final_params, strict=True):
        assert torch.equal(loaded.detach(), trained)


@pytest.mark.timeout(120)
def test_local_mode_leaves_no_process_group_behind(storage_path: str, tmp_path: Path) -> None:
    rendezvous = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")}
    result = TorchTrainer(
        lightning_train_func,
        train_loop_config={"package": LIGHTNING, "root": str(tmp_path / "lightning_root")},
        scaling_config=ScalingConfig(num_workers=0),
        run_config=RunConfig(name="lit", storage_path=storage_path),
    ).fit()
    assert [report["step"] for report in result.metrics_history] == [4, 8, 12]
    assert result.return_value["ranks"][0]["world"] == (1, 0, 0)
    assert not dist.is_initialized()
    assert {name: os.environ.get(name) for name in rendezvous} == rendezvous
    _check_reload(result, LIGHTNING, final_params=result.return_value["ranks"][0]["params"])


@pytest.mark.timeout(180)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP needs an accelerator (torch refuses CPU)")
def test_fsdp_on_one_gpu(storage_path: str, tmp_path: Path) -> None:
    result = TorchTrainer(
        lightning_train_func,
        train_loop_config={"package": LIGHTNING, "root": str(tmp_path / "lightning_root"), "strategy": "fsdp"},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
        run_config=RunConfig(name="lit", storage_path=storage_path),
    ).fit()
    assert result.return_value["ranks"][0]["device"] == "cuda:0"
    assert [report["epoch"] for report in result.metrics_history] == list(range(EPOCHS))
    with result.checkpoint.as_directory() as folder:
        model = lit_model_class(LIGHTNING).load_from_checkpoint(os.path.join(folder, "checkpoint.ckpt"))
    assert [tuple(p.shape) for p in model.parameters()] == [(16, FEATURES), (16,), (CLASSES, 16), (CLASSES,)]


def test_package_is_the_one_the_calling_code_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCKSTEP_LIGHTNING_PACKAGE", raising=False)
    pytorch_lightning = importlib.import_module("pytorch_lightning")
    lightning_pl = importlib.import_module("lightning.pytorch")
    assert choose_package({"pl": pytorch_lightning}, {}) == PYTORCH_LIGHTNING
    assert choose_package({}, {"Trainer": lightning_pl.Trainer}) == LIGHTNING
    assert choose_package({"L": importlib.import_module("lightning")}, {}) == LIGHTNING
    assert choose_package({}, {"model": lit_model_class(PYTORCH_LIGHTNING)()}) == PYTORCH_LIGHTNING

    callback = _callback_made_with(pytorch_lightning)  # both packages are imported: its local `pl` decides
    assert isinstance(callback, pytorch_lightning.Callback) and not isinstance(callback, lightning_pl.Callback)
    assert isinstance(callback, RayTrainReportCallback) and callback.state_key == "RayTrainReportCallback"
    monkeypatch.setenv("LOCKSTEP_LIGHTNING_PACKAGE", "lightning")
    assert isinstance(RayDDPStrategy(), lightning_pl.strategies.DDPStrategy)
    monkeypatch.setenv("LOCKSTEP_LIGHTNING_PACKAGE", "pytorch-lightning")
    with pytest.raises(ValueError, match="pytorch_lightning"):
        RayDDPStrategy()


def _callback_made_with(pl: Any) -> Any:
    return RayTrainReportCallback()


def test_user_subclass_keeps_its_methods() -> None:
    pl = importlib.import_module("lightning.pytorch")

    class EveryEpochAndMore(RayTrainReportCallback):
        def __init__(self) -> None:
            super().__init__()
            self.extra = "kept"

    callback = EveryEpochAndMore()
    assert isinstance(callback, (pl.Callback, RayTrainReportCallback, EveryEpochAndMore))
    assert callback.extra == "kept" and callback.CHECKPOINT_NAME == "checkpoint.ckpt"


def test_deepspeed_strategy_without_deepspeed_says_what_to_install() -> None:
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed")
    pl = importlib.import_module("lightning.pytorch")
    with pytest.raises(ImportError, match="pip install deepspeed"):
        RayDeepSpeedStrategy()
    assert pl


def test_prepare_trainer_refuses_a_trainer_not_set_up_for_lockstep() -> None:
    pl = importlib.import_module("lightning.pytorch")
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match="RayDDPStrategy"):
        prepare_trainer(trainer)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_example_on_a_subset(tmp_path: Path, data_dir: Path) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "examples" / "lightning_fashion_mnist.py"),
            "--smoke-test",
            "--epochs",
            "2",
            "--num-workers",
            "2",
            "--data-dir",
            str(data_dir),
            "--storage-path",
            str(tmp_path / "results"),
            "--name",
            "example",
        ],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, f"{completed.stdout}\n{completed.stderr}"
    assert "Last result: {" in completed.stdout and "'epoch': 1" in completed.stdout
    assert "Reloaded ImageClassifier with 203530 parameters" in completed.stdout
    assert len(list((tmp_path / "results" / "example").glob("checkpoint_*"))) == 2
