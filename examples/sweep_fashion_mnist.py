"""A hyperparameter sweep with Optuna: 8 trials of the Fashion-MNIST MLP (learning rate and
momentum), 2 at a time, each trial a lockstep fit() with its own 2 workers; Optuna's median
pruner stops the trials whose validation loss falls behind. Ends with the best parameters and a
plot comparing the trials.

    python examples/sweep_fashion_mnist.py --smoke-test --plot sweep.png

Several drivers (processes, machines, Ray jobs) can work on one study through Optuna's RDB
storage; start the same command in each, with the same study name and storage:

    python examples/sweep_fashion_mnist.py --study-storage sqlite:///sweep.db --study-name fmnist --trials 4

The train function and model are those of ``fashion_mnist_mlp.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import optuna

from lockstep import RunConfig, ScalingConfig
from lockstep.optuna import PruningCallback
from lockstep.torch import TorchTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fashion_mnist_mlp import train_func  # noqa: E402


def objective(trial: optuna.Trial, args: argparse.Namespace) -> float:
    """One trial: a fit() with the suggested learning rate and momentum; its last validation
    loss is the value (a pruned trial's fit() raises optuna.TrialPruned)."""
    config = {
        "lr": trial.suggest_float("lr", 1e-3, 0.3, log=True),
        "momentum": trial.suggest_float("momentum", 0.0, 0.95),
        "batch_size": 64,
        "epochs": args.epochs,
        "data_dir": args.data_dir,
        "limit": 4000 if args.smoke_test else None,
    }
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.num_workers),
        run_config=RunConfig(
            name=f"{args.study_name}_trial_{trial.number:02d}",
            storage_path=args.storage_path,
            worker_output="none",
            callbacks=[PruningCallback(trial, "loss")],
        ),
    )
    return trainer.fit().metrics["loss"]


def make_study(args: argparse.Namespace) -> optuna.Study:
    """The study: in memory, or shared by every driver that names the same RDB storage."""
    return optuna.create_study(
        study_name=args.study_name,
        storage=args.study_storage,
        load_if_exists=True,
        direction="minimize",
        sampler=optuna.samplers.TPESampler(seed=args.seed, n_startup_trials=4),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
    )


def trials_table(study: optuna.Study) -> str:
    """One line per trial: parameters, state, epochs run and last validation loss."""
    lines = ["trial  lr        momentum  state     epochs  val loss"]
    for trial in study.trials:
        last = trial.value if trial.value is not None else _last_value(trial)
        lines.append(
            f"{trial.number:>5}  {trial.params.get('lr', float('nan')):<8.4f}  "
            f"{trial.params.get('momentum', float('nan')):<8.3f}  {trial.state.name.lower():<8}  "
            f"{len(trial.intermediate_values):>6}  {last:.4f}"
        )
    return "\n".join(lines)


def _last_value(trial: optuna.trial.FrozenTrial) -> float:
    steps = trial.intermediate_values
    return steps[max(steps)] if steps else float("nan")


def plot_trials(study: optuna.Study, path: str) -> str:
    """Validation loss per epoch of every trial: completed ones solid, pruned ones dashed and
    ending where they were stopped, the best one thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    best = study.best_trial.number if any(t.state.name == "COMPLETE" for t in study.trials) else None
    figure, axis = plt.subplots(figsize=(9, 4.5))
    for trial in study.trials:
        steps = sorted(trial.intermediate_values)
        if not steps:
            continue
        pruned, is_best = trial.state.name == "PRUNED", trial.number == best
        epochs, losses = [step + 1 for step in steps], [trial.intermediate_values[step] for step in steps]
        (line,) = axis.plot(
            epochs,
            losses,
            linestyle="--" if pruned else "-",
            marker="o",
            markersize=4,
            linewidth=3 if is_best else 1.4,
            color="black" if is_best else None,
            zorder=3 if is_best else 2,
            label=f"#{trial.number} lr={trial.params['lr']:.3g} momentum={trial.params['momentum']:.2f}"
            + (" (pruned)" if pruned else " (best)" if is_best else ""),
        )
        if pruned:
            axis.plot(epochs[-1:], losses[-1:], marker="X", markersize=10, color=line.get_color(), linestyle="none")
    axis.set_xlabel("epoch")
    axis.set_ylabel("validation loss")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axis.set_title(
        f"Fashion-MNIST MLP, {len(study.trials)} Optuna trials (X: pruned by the median pruner)", fontsize=11
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8, help="trials this driver runs")
    parser.add_argument("--jobs", type=int, default=2, help="trials at once (threads of this driver)")
    parser.add_argument("--num-workers", "-n", type=int, default=2, help="workers per trial")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per trial (default 8, smoke test 5)")
    parser.add_argument("--smoke-test", action="store_true", help="4,000 images, 5 epochs: about a minute on 2 CPUs")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    parser.add_argument("--study-name", default=None, help="default: sweep_<time>")
    parser.add_argument(
        "--study-storage",
        default=None,
        help="Optuna RDB storage shared by several drivers, e.g. sqlite:///sweep.db (default: in memory)",
    )
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST root (default: $LOCKSTEP_DATA, else ~/data)")
    parser.add_argument("--storage-path", default=None, help="where runs are kept (default ~/lockstep_results)")
    parser.add_argument("--plot", default="sweep_fashion_mnist.png", help="PNG comparing the trials")
    args = parser.parse_args(argv)
    args.epochs = args.epochs or (5 if args.smoke_test else 8)
    args.study_name = args.study_name or time.strftime("sweep_%Y%m%d_%H%M%S")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    args = parse_args(argv)
    study = make_study(args)
    started = time.monotonic()
    study.optimize(lambda trial: objective(trial, args), n_trials=args.trials, n_jobs=args.jobs)
    print(trials_table(study))
    print(
        f"{len(study.trials)} trials in {time.monotonic() - started:.0f} s; "
        f"best: trial #{study.best_trial.number}, validation loss {study.best_value:.4f}, "
        f"params {{'lr': {study.best_params['lr']:.4f}, 'momentum': {study.best_params['momentum']:.3f}}}"
    )
    if args.plot:
        print(f"Plot: {os.path.abspath(plot_trials(study, args.plot))}")


if __name__ == "__main__":
    main()
