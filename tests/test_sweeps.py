"""Sweeps and stopping: RunConfig(stop=...), callbacks that stop a run (EarlyStopping, Optuna's
PruningCallback), several fits at once from threads of one driver, several driver processes on
one Optuna study, `lockstep plot` of several runs, and the sweep example's smoke test."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
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
                mode = (
                    lockstep.CheckpointUploadMode.ASYNC if config.get("async") else lockstep.CheckpointUploadMode.SYNC
                )
                lockstep.report(metrics, checkpoint=Checkpoint.from_directory(folder), checkpoint_upload_mode=mode)
        else:
            lockstep.report(metrics)
    return {"ran_to_the_end": True}


def fit(
    storage_path: str,
    name: str,
    losses: list[float],
    workers: int = 2,
    every: int = 1,
    upload_async: bool = False,
    **run_config: Any,
) -> lockstep.Result:
    trainer = TorchTrainer(
        count_down,
        train_loop_config={"losses": losses, "every": every, "async": upload_async},
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

    result = fit(storage_path, "function", LOSSES, every=2, upload_async=True, stop=below)
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
    result = fit(
        storage_path, "early", LOSSES, callbacks=[EarlyStopping("loss", mode="min", patience=2, min_delta=0.02)]
    )
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


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_fits_at_once_share_one_progress_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The terminal's line shows the oldest running fit; another one writes its last state when
    it ends, and the line goes on; the next oldest takes it over."""
    from lockstep._internal.output import progress

    monkeypatch.setenv("TERM", "xterm")
    screen = Terminal()
    first, second = progress.ProgressCallback("first", 2, screen), progress.ProgressCallback("second", 2, screen)
    runs = {line: RunInfo(line.name, "/r", 2, "/r/logs") for line in (first, second)}
    for line in (first, second):
        line.on_run_start(runs[line])
    first.after_report(runs[first], 0, {"loss": 1.0})
    second.after_report(runs[second], 0, {"loss": 2.0})
    assert "second" not in screen.getvalue() and "loss=1" in screen.getvalue()
    second.on_run_end(runs[second], "pruned", None)
    first.after_report(runs[first], 1, {"loss": 0.5})
    first.on_run_end(runs[first], "finished", None)
    shown = [part for part in screen.getvalue().replace("\x1b[K", "").split("\r") if part.strip()]
    assert [part.split(" | ")[0] + " | " + part.split(" | ")[-1].strip() for part in shown] == [
        "lockstep first | loss=1",  # report #0 of the first; the second's is not drawn
        "lockstep second | pruned",  # the second fit's end, on a line of its own
        "lockstep first | loss=1",
        "lockstep first | loss=0.5",
        "lockstep first | finished",
    ]
    assert progress._active is None and progress._running == []


# -- Optuna: pruning, and fits side by side --------------------------------------------------------

try:
    import optuna

    import lockstep.optuna
except ImportError:  # the tests above run without Optuna; those below need it
    optuna = None
needs_optuna = pytest.mark.skipif(optuna is None, reason="needs optuna (pip install 'lockstep[optuna]')")


OVERLAP_WAIT_S = 60


def meet_the_other_trial(meet_dir: str, tag: str, other: str) -> None:
    """Say that trial ``tag`` runs, and wait until trial ``other`` runs too: two fits run at once
    only if each sees the other started while it runs (fits run one after the other fail here)."""
    Path(meet_dir, tag).touch()
    deadline = time.monotonic() + OVERLAP_WAIT_S
    while not Path(meet_dir, other).exists():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"trial {other} did not start within {OVERLAP_WAIT_S} s while trial {tag} ran: "
                "the two fits did not overlap"
            )
        time.sleep(0.02)


def scaled_losses(config: dict[str, Any]) -> None:
    """Reports loss = scale * (1 - step / 10) with a checkpoint each time; with ``meet_dir``,
    rank 0 first waits until the other trial has started (so the two fits overlap for sure)."""
    context = lockstep.get_context()
    if config.get("meet_dir") and context.get_world_rank() == 0:
        meet_the_other_trial(config["meet_dir"], config["tag"], config["other"])
    for step in range(4):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, f"rank{context.get_world_rank()}.txt").write_text(config["tag"])
            print(f"trial {config['tag']} rank {context.get_world_rank()} step {step}", flush=True)
            lockstep.report(
                {"loss": config["scale"] * (1 - step / 10), "tag": config["tag"]},
                checkpoint=Checkpoint.from_directory(folder),
            )


class RunsSeen(Callback):
    """Which run each hook was called for (a callback must only hear of its own fit)."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.tags: set[str] = set()

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        self.names.add(run.name)
        self.tags.add(metrics["tag"])


def optuna_objective(storage_path: str, seen: dict[int, RunsSeen], meet_dir: str | None = None) -> Any:
    def objective(trial: Any) -> float:
        scale = trial.suggest_float("scale", 0.1, 10.0)
        seen[trial.number] = RunsSeen()
        config = {"scale": scale, "tag": f"t{trial.number}", "other": f"t{1 - trial.number}", "meet_dir": meet_dir}
        trainer = TorchTrainer(
            scaled_losses,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(
                name=f"trial_{trial.number}",
                storage_path=storage_path,
                verbose=0,
                callbacks=[lockstep.optuna.PruningCallback(trial, "loss"), seen[trial.number]],
            ),
        )
        return trainer.fit().metrics["loss"]

    return objective


@needs_optuna
@pytest.mark.timeout(120)
def test_two_trials_at_once_one_pruned(storage_path: str, tmp_path: Path) -> None:
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=1.5, n_warmup_steps=1))
    study.enqueue_trial({"scale": 0.5})
    study.enqueue_trial({"scale": 2.0})  # 2.0, 1.8 > 1.5 at report #1: pruned there
    seen: dict[int, RunsSeen] = {}
    threads_before = threading.active_count()
    meet_dir = tmp_path / "meet"
    meet_dir.mkdir()
    study.optimize(optuna_objective(storage_path, seen, meet_dir=str(meet_dir)), n_trials=2, n_jobs=2)
    assert {path.name for path in meet_dir.iterdir()} == {"t0", "t1"}, "both trials met while running"
    states = {trial.number: trial.state for trial in study.trials}
    assert states == {0: optuna.trial.TrialState.COMPLETE, 1: optuna.trial.TrialState.PRUNED}
    assert study.best_value == pytest.approx(0.5 * 0.7)
    assert study.trials[1].intermediate_values == {0: 2.0, 1: pytest.approx(1.8)}
    good, pruned = record_of(storage_path, "trial_0"), record_of(storage_path, "trial_1")
    assert good["status"] == "finished" and good["num_reports"] == 4
    assert (
        pruned["status"] == "pruned" and pruned["num_reports"] == 2 and "Optuna pruned trial 1" in pruned["stop_reason"]
    )
    assert pruned["latest_checkpoint"] == "checkpoint_000001"
    # nothing leaks between the two fits: callbacks, checkpoint files, logs
    assert [(s.names, s.tags) for s in (seen[0], seen[1])] == [({"trial_0"}, {"t0"}), ({"trial_1"}, {"t1"})]
    for number in (0, 1):
        run = Path(storage_path, f"trial_{number}")
        files = {p.read_text() for p in run.glob("checkpoint_*/rank*.txt")}
        assert files == {f"t{number}"}
        log = (run / "logs" / "rank_0.log").read_text()
        assert f"trial t{number} rank 0" in log and f"trial t{1 - number}" not in log
    assert threading.active_count() <= threads_before + 1, "no driver thread left running"


@needs_optuna
@pytest.mark.timeout(60)
def test_fit_raises_trial_pruned(storage_path: str) -> None:
    from lockstep.optuna import PruningCallback

    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=0.5))
    trial = study.ask()
    with pytest.raises(optuna.TrialPruned, match="at report #0"):
        fit(storage_path, "pruned", LOSSES, callbacks=[PruningCallback(trial, "loss")])
    assert record_of(storage_path, "pruned")["status"] == "pruned"


def test_pruning_callback_without_optuna_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import lockstep.optuna

    monkeypatch.setitem(sys.modules, "optuna", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'lockstep\[optuna\]'"):
        lockstep.optuna.PruningCallback(object(), "loss")


def wait_for(config: dict[str, threading.Event]) -> None:
    assert config["event"].wait(30), "the other fit never tried to start"
    lockstep.report({"loss": 1.0})


@pytest.mark.timeout(60)
def test_two_local_mode_fits_at_once_are_refused(storage_path: str) -> None:
    tried = threading.Event()
    first: dict[str, Any] = {}

    def run_first() -> None:
        trainer = TorchTrainer(
            wait_for,
            train_loop_config={"event": tried},
            scaling_config=ScalingConfig(num_workers=0),
            run_config=RunConfig(name="first", storage_path=storage_path, verbose=0),
        )
        first["result"] = trainer.fit()

    thread = threading.Thread(target=run_first)
    thread.start()
    try:
        for _ in range(200):
            if Path(storage_path, "first", "lockstep_run.json").exists():
                break
            threading.Event().wait(0.05)
        with pytest.raises(ValueError, match="'first' already does so from another thread"):
            fit(storage_path, "second", LOSSES, workers=0)
    finally:
        tried.set()
        thread.join(30)
    assert first["result"].metrics == {"loss": 1.0}
    assert not Path(storage_path, "second", "lockstep_run.json").exists(), "refused before its record was opened"


def test_cpus_of_fits_at_once_are_counted_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from lockstep._internal.executors import local_resources

    monkeypatch.setattr(local_resources, "_warned_together", False)
    cpus = os.cpu_count() or 1
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        with local_resources.cpus_in_use(cpus):
            assert not caplog.records, "one fit within the machine: nothing to say"
            with local_resources.cpus_in_use(1), local_resources.cpus_in_use(1):
                pass
        with local_resources.cpus_in_use(cpus), local_resources.cpus_in_use(cpus):
            pass
    assert [record.getMessage() for record in caplog.records] == [
        f"2 fits at once ask for {cpus + 1:g} CPUs in all, but this machine has {cpus}; their workers will share "
        "cores and run slower (run fewer at once, e.g. Optuna's n_jobs)."
    ]
    assert local_resources._cpus_in_use == []


# -- comparing runs ----------------------------------------------------------------------------------


@needs_optuna
@pytest.mark.timeout(90)
def test_runs_lists_stopped_and_pruned_and_plot_overlays_runs(
    storage_path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lockstep import cli

    fit(storage_path, "full", LOSSES[:4])
    fit(storage_path, "stopped", LOSSES, stop={"training_iteration": 2})
    trial = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=0.5)).ask()
    with pytest.raises(optuna.TrialPruned):
        fit(storage_path, "pruned", LOSSES, callbacks=[lockstep.optuna.PruningCallback(trial, "loss")])
    assert cli.main(["runs", storage_path]) == 0
    table = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert table == {"full": "finished", "stopped": "stopped", "pruned": "pruned"}

    output = tmp_path / "overlay.png"
    assert (
        cli.main(["plot", "full", "stopped", "pruned", "--storage", storage_path, "-m", "loss", "-o", str(output)]) == 0
    )
    assert "wrote" in capsys.readouterr().out and output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(str(output)).shape[0] > 300
    assert cli.main(["plot", "full", "nonexistent", "--storage", storage_path, "-o", str(output)]) == 2
    assert "nonexistent" in capsys.readouterr().err


# -- the example: one driver, and two drivers on one study -------------------------------------------

EXAMPLE = REPO / "examples" / "sweep_fashion_mnist.py"


def run_example(args: list[str], data_dir: Path, storage_path: str, timeout: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, str(EXAMPLE), "--data-dir", str(data_dir), "--storage-path", storage_path, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def finished(process: subprocess.Popen[str], timeout: float) -> str:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
    assert process.returncode == 0, f"{out}\n{err}"
    return out


def statuses(storage_path: str) -> dict[str, str]:
    return {
        path.parent.name: json.loads(path.read_text())["status"]
        for path in Path(storage_path).glob("*/lockstep_run.json")
    }


@needs_optuna
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sweep_example_smoke_test(storage_path: str, tmp_path: Path, data_dir: Path) -> None:
    plot = tmp_path / "sweep.png"
    out = finished(
        run_example(["--smoke-test", "--study-name", "smoke", "--plot", str(plot)], data_dir, storage_path, 190), 190
    )
    assert "8 trials in" in out and "best: trial #" in out and f"Plot: {plot}" in out, out
    table = [line.split() for line in out.splitlines() if line[:5].strip().isdigit()]
    assert len(table) == 8 and {row[3] for row in table} <= {"complete", "pruned"}
    runs = statuses(storage_path)
    assert runs == {f"smoke_trial_{int(row[0]):02d}": "finished" if row[3] == "complete" else "pruned" for row in table}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_optuna
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_driver_processes_work_on_one_sqlite_study(storage_path: str, tmp_path: Path, data_dir: Path) -> None:
    database = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(study_name="shared", storage=database)  # as `optuna create-study` would, once
    args = [
        "--smoke-test",
        "--epochs",
        "2",
        "--trials",
        "1",
        "--jobs",
        "1",
        "--study-name",
        "shared",
        "--study-storage",
        database,
        "--plot",
        "",
    ]
    drivers = [run_example([*args, "--seed", str(seed)], data_dir, storage_path, 190) for seed in (1, 2)]
    outputs = [finished(driver, 190) for driver in drivers]
    study = optuna.load_study(study_name="shared", storage=database)
    assert sorted(trial.number for trial in study.trials) == [0, 1], "one trial each, numbered by the shared study"
    assert all(trial.state.is_finished() and len(trial.intermediate_values) >= 1 for trial in study.trials)
    assert set(statuses(storage_path)) == {"shared_trial_00", "shared_trial_01"}
    assert any("2 trials in" in out for out in outputs), "the driver that ends last sees both drivers' trials"
