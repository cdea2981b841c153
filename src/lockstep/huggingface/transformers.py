"""Hugging Face ``transformers.Trainer`` inside a lockstep train function.

The import swap from Ray Train is ``ray.train.huggingface.transformers`` ->
``lockstep.huggingface.transformers``::

    from lockstep.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    def train_func():
        trainer = transformers.Trainer(model=model, args=args, train_dataset=..., eval_dataset=...)
        trainer.add_callback(RayTrainReportCallback())
        trainer = prepare_trainer(trainer)
        trainer.train()

The Trainer joins the process group lockstep's TorchConfig already made in each worker:
``trainer.args.world_size`` is the number of workers and the model is wrapped in DDP.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import transformers
from torch.utils.data import DataLoader, Dataset, IterableDataset
from transformers.trainer_callback import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

import lockstep
from lockstep._internal.rank.progress import count_forward_passes
from lockstep.checkpoint import Checkpoint

__all__ = ["RayTrainReportCallback", "prepare_trainer"]


logger = logging.getLogger(__name__)

ReportOn = Literal["save", "evaluate", "log"]
REPORT_ON_CHOICES: tuple[str, ...] = ("save", "evaluate", "log")


def merged_logs(state: TrainerState) -> dict[str, Any]:
    """Every key ever logged by the Trainer with its latest value (``step``, ``epoch``, ``loss``,
    ``eval_loss``, …): the log history folded oldest to newest."""
    metrics: dict[str, Any] = {}
    for entry in state.log_history:
        metrics.update(entry)
    return metrics


class RayTrainReportCallback(TrainerCallback):
    """Reports the Trainer's metrics and checkpoints to lockstep (``lockstep.report``).

    At each checkpoint save it reports the merged log history (the latest value of every logged
    metric) with the checkpoint the Trainer just wrote, as Ray Train's callback does. The
    reported checkpoint folder holds the Hugging Face checkpoint under ``checkpoint/``::

        checkpoint_000003/        lockstep checkpoint (Result.checkpoint.path)
        └── checkpoint/           the Trainer's checkpoint-<step> folder
            ├── config.json
            ├── model.safetensors
            └── ...

    Load the model back with ``AutoModel...from_pretrained(os.path.join(path, "checkpoint"))``.

    Ray Train reports only at saves, so metrics appear only at save steps. ``report_on`` adds
    reports without a checkpoint in between:

    * ``"save"`` (default, Ray's behaviour): a report at each checkpoint save only.
    * ``"evaluate"``: also a report after each evaluation, so every ``eval_*`` metric is
      recorded at the step it was computed. When the Trainer saves at the same step, the
      save's report (which carries the same metrics) is the only one.
    * ``"log"``: also a report after every log event (training loss every ``logging_steps``,
      evaluation results, the end-of-training summary).

    ``lockstep.report`` is a collective: every rank calls it the same number of times. The
    Trainer calls ``on_save``, ``on_evaluate`` and ``on_log`` on every rank at the same steps,
    so add this callback on every rank (the train function does).

    Set the Trainer's ``eval_steps``/``save_steps`` so that evaluations happen at save steps
    (``save_steps`` a multiple of ``eval_steps``) if the save reports should carry fresh
    evaluation metrics, e.g. for ``CheckpointConfig(checkpoint_score_attribute="eval_loss")``.

    Args:
        report_on: ``"save"``, ``"evaluate"`` or ``"log"``, see above.

    Example::

        trainer.add_callback(RayTrainReportCallback(report_on="evaluate"))
    """

    #: The folder inside the reported checkpoint that holds the Trainer's checkpoint.
    CHECKPOINT_NAME = "checkpoint"

    def __init__(self, report_on: ReportOn = "save") -> None:
        super().__init__()
        if report_on not in REPORT_ON_CHOICES:
            raise ValueError(
                f"RayTrainReportCallback(report_on={report_on!r}) is not a choice; use one of {REPORT_ON_CHOICES}: "
                "'save' reports at checkpoint saves only, 'evaluate' also after each evaluation, "
                "'log' also after every log event."
            )
        self.report_on = report_on

    def on_save(
        self, args: transformers.TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Report the merged logs with the checkpoint the Trainer has just saved."""
        source = _checkpoint_folder(str(args.output_dir), state.global_step)
        with tempfile.TemporaryDirectory(prefix="lockstep_hf_") as staging:
            checkpoint = None
            if source is not None and _is_first_with_folder(source):
                shutil.copytree(source, os.path.join(staging, self.CHECKPOINT_NAME))
                checkpoint = Checkpoint.from_directory(staging)
            lockstep.report(merged_logs(state), checkpoint=checkpoint)

    def on_evaluate(
        self, args: transformers.TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """With ``report_on="evaluate"``: report the merged logs, unless a save follows at this step."""
        if self.report_on == "evaluate" and not control.should_save:
            lockstep.report(merged_logs(state))

    def on_log(
        self, args: transformers.TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """With ``report_on="log"``: report the merged logs after every log event."""
        if self.report_on == "log":
            lockstep.report(merged_logs(state))


def _checkpoint_folder(output_dir: str, global_step: int) -> str | None:
    """The folder the Trainer saved for ``global_step``, else its latest one (None: none)."""
    folder = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")
    if os.path.isdir(folder):
        return folder
    latest = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if latest is None:
        logger.warning("no checkpoint folder in %s at step %d; reporting metrics only", output_dir, global_step)
    return latest


def _is_first_with_folder(folder: str | None) -> bool:
    """Whether this rank should report ``folder``: it has one, and no lower rank on this host
    has the same one (ranks sharing an ``output_dir`` would upload the same files twice).

    Gathering the folders across ranks also waits until every rank has finished writing its
    part (rank 0 the model and optimizer, each rank its RNG state) before anything is copied.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return folder is not None
    mine = (socket.gethostname(), os.path.realpath(folder)) if folder is not None else None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return mine is not None and mine not in everyone[: dist.get_rank()]


# -- prepare_trainer -----------------------------------------------------------------------------


class BatchIterableDataset(IterableDataset):
    """A torch ``IterableDataset`` over an iterable that yields whole batches (what
    ``shard.iter_torch_batches(...)`` returns), so a ``DataLoader`` can hand them on unchanged."""

    def __init__(self, batches: Iterable[Any]) -> None:
        super().__init__()
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)


def _only_item(items: list[Any]) -> Any:
    """The collate function of a DataLoader of batch size 1 over ready-made batches."""
    return items[0]


def is_batch_iterable(dataset: Any) -> bool:
    """Whether ``dataset`` is an iterable of ready-made batches (a Ray Data or lockstep shard's
    ``iter_torch_batches(...)``/``iter_batches(...)``), not a dataset the Trainer batches itself."""
    if dataset is None or isinstance(dataset, (Dataset, str, bytes, dict)):
        return False
    if type(dataset).__module__.partition(".")[0] == "datasets":  # Hugging Face datasets: examples, not batches
        return False
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


def batch_loader(batches: Iterable[Any]) -> DataLoader:
    """A DataLoader that yields the batches of ``batches`` as they are: this rank's shard,
    already batched, so it is neither re-batched nor split again across ranks."""
    return DataLoader(BatchIterableDataset(batches), batch_size=1, collate_fn=_only_item)


def prepare_trainer(trainer: transformers.Trainer) -> transformers.Trainer:
    """Let ``trainer`` take iterables of batches as its train and eval datasets.

    On the Ray executor, ``lockstep.get_dataset_shard("train").iter_torch_batches(batch_size=...)``
    yields this rank's part of a Ray Dataset, already batched. The Trainer would batch it again
    and split it across ranks again; after ``prepare_trainer`` its data loaders pass such
    batches through unchanged (set ``max_steps``: an iterable has no length). Torch datasets
    and Hugging Face ``datasets`` are left to the Trainer as they are (it shards them itself).

    The trainer's class is swapped for a subclass of it in place; the same object is returned.

    Example::

        train_batches = lockstep.get_dataset_shard("train").iter_torch_batches(batch_size=16)
        trainer = prepare_trainer(Trainer(model, args, train_dataset=train_batches))
    """
    if not isinstance(trainer, transformers.Trainer):
        raise TypeError(f"prepare_trainer() takes a transformers.Trainer, got {type(trainer).__name__}.")
    trainer.__class__ = _batch_iterable_trainer_class(type(trainer))
    if isinstance(trainer.model, torch.nn.Module):  # its evaluation loop is progress too, for the hang detector
        count_forward_passes(trainer.model)
    return trainer


def _batch_iterable_trainer_class(base: type[transformers.Trainer]) -> type[transformers.Trainer]:
    """``base`` with data loaders that pass iterables of batches through."""
    if getattr(base, "_lockstep_prepared", False):
        return base

    class LockstepTrainer(base):  # type: ignore[misc, valid-type]
        """A Trainer whose data loaders pass iterables of batches through (see prepare_trainer)."""

        _lockstep_prepared = True

        def get_train_dataloader(self) -> DataLoader:
            if is_batch_iterable(self.train_dataset):
                return batch_loader(self.train_dataset)
            return super().get_train_dataloader()

        def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
            chosen = eval_dataset if eval_dataset is not None else self.eval_dataset
            if isinstance(chosen, str) and isinstance(self.eval_dataset, dict):
                chosen = self.eval_dataset[chosen]
            if not isinstance(chosen, str) and is_batch_iterable(chosen):
                return batch_loader(cast(Iterable[Any], chosen))
            return super().get_eval_dataloader(eval_dataset)

    LockstepTrainer.__name__ = LockstepTrainer.__qualname__ = f"Lockstep{base.__name__}"
    return LockstepTrainer
