"""Ray Train's Hugging Face Transformers script shape on lockstep: a ``transformers.Trainer``
fine-tunes a small BERT for sequence classification on every worker, and
``RayTrainReportCallback`` reports its evaluation metrics and checkpoints.

    python examples/transformers_text_classification.py --num-workers 2 --smoke-test

Everything is offline: the model is randomly initialised from a ``BertConfig`` and the data is
synthetic (random token ids; a sequence is positive when it holds more "positive" tokens, ids
below half the vocabulary, than negative ones), so nothing is downloaded. Moving a Ray Train
script here takes its imports only: ``ray.train`` -> ``lockstep``,
``ray.train.huggingface.transformers`` -> ``lockstep.huggingface.transformers``.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # set before transformers is imported, here and in workers

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import lockstep as train  # noqa: E402
from lockstep import CheckpointConfig, RunConfig, ScalingConfig  # noqa: E402
from lockstep.huggingface.transformers import RayTrainReportCallback, prepare_trainer  # noqa: E402
from lockstep.torch import TorchTrainer  # noqa: E402

VOCAB_SIZE, SEQUENCE_LENGTH = 100, 16


class SyntheticSentiment(torch.utils.data.Dataset):
    """Random token sequences labelled 1 when most of their tokens are "positive" (id < 50)."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, VOCAB_SIZE, (size, SEQUENCE_LENGTH), generator=generator)
        self.labels = ((self.input_ids < VOCAB_SIZE // 2).sum(dim=1) > SEQUENCE_LENGTH // 2).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": torch.ones(SEQUENCE_LENGTH, dtype=torch.long),
            "labels": self.labels[index],
        }


def small_bert(hidden_size: int) -> transformers.BertForSequenceClassification:
    """A randomly initialised BERT classifier (built from a config: no download)."""
    config = transformers.BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=SEQUENCE_LENGTH,
        num_labels=2,
    )
    return transformers.BertForSequenceClassification(config)


def compute_metrics(prediction: transformers.EvalPrediction) -> dict[str, float]:
    """Accuracy of the argmax class over the evaluation set (gathered from every worker)."""
    predicted = np.argmax(prediction.predictions, axis=-1)
    return {"accuracy": float((predicted == prediction.label_ids).mean())}


def train_func(config: dict[str, Any]) -> None:
    """Runs on every worker: the Trainer joins lockstep's process group and wraps the model in DDP."""
    args = transformers.TrainingArguments(
        output_dir=config["output_dir"],
        max_steps=config["max_steps"],
        per_device_train_batch_size=16,
        per_device_eval_batch_size=64,
        learning_rate=config["lr"],
        warmup_steps=config["max_steps"] // 10,
        eval_strategy="steps",
        eval_steps=config["eval_steps"],
        save_strategy="steps",
        save_steps=2 * config["eval_steps"],
        logging_steps=config["eval_steps"],
        report_to="none",
        disable_tqdm=True,
        seed=0,
        # The Trainer would scale the loss by the number of workers for models whose forward takes
        # **kwargs (BERT's does) even though BERT's loss is a plain mean: keep the per-worker mean.
        average_tokens_across_devices=False,
    )
    trainer = transformers.Trainer(
        model=small_bert(config["hidden_size"]),
        args=args,
        compute_metrics=compute_metrics,
        train_dataset=SyntheticSentiment(config["train_size"], seed=1),
        eval_dataset=SyntheticSentiment(512, seed=2),
    )
    # report_on="evaluate": metrics at every evaluation, not only at the saves (with checkpoints).
    trainer.add_callback(RayTrainReportCallback(report_on="evaluate"))
    trainer = prepare_trainer(trainer)
    trainer.train()


def run(args: argparse.Namespace) -> train.Result:
    """Train with lockstep and return the Result."""
    max_steps = 40 if args.smoke_test else args.max_steps
    trainer = TorchTrainer(
        train_func,
        train_loop_config={
            "output_dir": os.path.join(args.output_dir, "hf_trainer"),
            "max_steps": max_steps,
            "eval_steps": max(1, max_steps // 4),
            "lr": args.lr,
            "hidden_size": 32 if args.smoke_test else 64,
            "train_size": 2048 if args.smoke_test else 8192,
        },
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
        run_config=RunConfig(
            name=args.name,
            storage_path=args.storage_path,
            checkpoint_config=CheckpointConfig(
                num_to_keep=1, checkpoint_score_attribute="eval_accuracy", checkpoint_score_order="max"
            ),
        ),
    )
    return trainer.fit()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-workers", "-n", type=int, default=2, help="number of workers")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker")
    parser.add_argument("--max-steps", type=int, default=400, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--smoke-test", action="store_true", help="a smaller model and 40 steps, for a quick check")
    parser.add_argument("--output-dir", default="/tmp/lockstep_transformers", help="the Trainer's own output_dir")
    parser.add_argument("--storage-path", default=None, help="where runs are kept (default ~/lockstep_results)")
    parser.add_argument("--name", default=None, help="run name (default: TorchTrainer_<time>)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    result = run(args)
    history = result.metrics_dataframe
    print(history[["step", "loss", "eval_loss", "eval_accuracy", "checkpoint_dir_name"]].to_string(index=False))
    best = result.get_best_checkpoint("eval_accuracy", "max")
    model = transformers.BertForSequenceClassification.from_pretrained(
        os.path.join(best.path, RayTrainReportCallback.CHECKPOINT_NAME)
    )
    print(f"Best checkpoint: {best.path} ({sum(p.numel() for p in model.parameters())} parameters reloaded)")
    print(f"Last result: eval_accuracy={result.metrics['eval_accuracy']:.3f} at step {result.metrics['step']}")


if __name__ == "__main__":
    main()
