"""The hang detector: a rank that stops making progress while the others wait is named, with
where every rank is, within max(FailureConfig.hang_timeout_s, hang_step_multiple x the median
step time) (hang_first_step_timeout_s before the first step); and long work that is progress,
or short enough, is no hang.

The rule and the naming are checked on recorded times and scripted answers (no processes);
the rest on real runs of 2-3 CPU ranks (gloo, DDP on a small model) with thresholds of a few
seconds set through FailureConfig, so each takes seconds. The Ray executor's case is in
test_ray.py, torchrun's in test_scripts.py.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import stacks_by_rank
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from lockstep import Checkpoint, FailureConfig, RunConfig, ScalingConfig, WorkerGroupError
from lockstep._internal.rank.progress import RankProgress
from lockstep._internal.run.hang_diagnosis import hang_failures, ranks_text
from lockstep._internal.run.hang_watch import PROBE_WAIT_S, HangRule, HangWatch
from lockstep._internal.wire import protocol
from lockstep.callbacks import Callback
from lockstep.torch import TorchTrainer, prepare_data_loader, prepare_model

# -- the rule, on recorded times ----------------------------------------------------------------


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def median_of_recorded_steps(step_times_s: list[float]) -> float | None:
    """The median step time a rank reports after steps of these durations."""
    clock_ns = [0]
    progress = RankProgress(clock=lambda: clock_ns[0])
    progress.step_done()
    for step_s in step_times_s:
        clock_ns[0] += int(step_s * 1e9)
        progress.step_done()
    return progress.median_step_s()


@pytest.mark.parametrize(
    ("step_times_s", "threshold_s"),
    [
        ([30.0, 1.0, 1.2, 0.9, 1.1, 1.0], 60.0),  # a 30x slow step among 1 s ones: 60 s, the floor
        ([8.0, 8.4, 7.6, 8.2, 90.0, 8.0], 81.0),  # 8 s steps: 10 x the median (8.1 s), an outlier ignored
        ([0.05] * 30, 60.0),
    ],
)
def test_the_default_threshold_is_60_s_or_10_median_steps(step_times_s: list[float], threshold_s: float) -> None:
    clock = Clock()
    watch = HangWatch(HangRule.from_config(FailureConfig()), clock)  # type: ignore[arg-type]
    assert watch.time_to_deadline() == 600.0, "before the first step: hang_first_step_timeout_s"
    step_s = median_of_recorded_steps(step_times_s)
    watch.progress(protocol.Progress(rank=0, work=len(step_times_s) * 3, steps=len(step_times_s) + 1, step_s=step_s))
    assert watch.threshold_s() == pytest.approx(threshold_s)
    clock.now += threshold_s - 0.01
    assert not watch.due()
    watch.progress(protocol.Progress(rank=1, work=7, steps=7, step_s=step_s))  # another rank moved: the clock restarts
    clock.now += threshold_s - 0.01
    assert not watch.due()
    clock.now += 0.01
    assert watch.due() and watch.quiet_s() == pytest.approx(threshold_s)


def test_lockstep_s_own_long_work_holds_the_alarm_off_and_progress_calls_it_off() -> None:
    clock = Clock()
    watch = HangWatch(HangRule(timeout_s=5.0), clock)
    watch.progress(protocol.Progress(rank=0, work=10, steps=3, busy=True))
    clock.now += 3600
    assert watch.time_to_deadline() is None and not watch.due(), "a rank uploading a checkpoint is making progress"
    watch.progress(protocol.Progress(rank=0, work=11, steps=3, busy=False))
    clock.now += 5
    assert watch.due()
    watch.start_probe([0, 1])
    watch.answered(protocol.Stacks(rank=0, stacks="here"))
    assert not watch.probe_over() and watch.time_to_deadline() == PROBE_WAIT_S
    watch.saw_progress()  # rank 1 reported meanwhile
    assert watch.probe_started_at is None and not watch.answers and not watch.due()


def test_without_steps_report_intervals_are_the_step_time() -> None:
    clock = Clock()
    watch = HangWatch(HangRule(timeout_s=1.0, step_multiple=10), clock)
    for _ in range(3):
        clock.now += 4.0
        watch.report_done()
    assert watch.stepped and watch.step_s == 4.0 and watch.threshold_s() == 40.0


def test_the_settings_are_checked_and_none_turns_the_detector_off() -> None:
    assert HangRule.from_config(FailureConfig(hang_timeout_s=None)) is None
    assert HangRule(timeout_s=60.0).progress_every_s == 5.0 and HangRule(timeout_s=2.0).progress_every_s == 0.5
    for field, value in [
        ("hang_timeout_s", 0),
        ("hang_timeout_s", "60"),
        ("hang_first_step_timeout_s", -1.0),
        ("hang_step_multiple", 0.5),
        ("hang_step_multiple", None),
    ]:
        with pytest.raises(ValueError, match=rf"FailureConfig\.{field} must be"):
            FailureConfig(**{field: value})


# -- who is named, on scripted answers ------------------------------------------------------------


def probed_watch(answers: dict[int, protocol.Stacks], work: dict[int, int] | None = None) -> HangWatch:
    clock = Clock()
    watch = HangWatch(HangRule(timeout_s=2.0), clock)
    for rank, done in (work or {}).items():
        watch.progress(protocol.Progress(rank=rank, work=done, steps=1))
    clock.now += 2.5
    watch.start_probe(sorted(answers))
    for answer in answers.values():
        watch.answered(answer)
    return watch


def test_without_the_flight_recorder_the_rank_behind_is_named() -> None:
    watch = probed_watch(
        {rank: protocol.Stacks(rank=rank, stacks="", work=work) for rank, work in [(0, 40), (1, 37), (2, 40)]}
    )
    failures = hang_failures(watch, [0, 1, 2], {})
    assert [failure.rank for failure in failures] == [1] and failures[0].error_type == "Hang"
    assert "is behind (progress count 37, others up to 40)" in failures[0].message


def test_ranks_equally_far_and_waiting_in_nothing_are_all_named_and_the_error_says_none_is_behind() -> None:
    watch = probed_watch(
        {rank: protocol.Stacks(rank=rank, stacks="", collectives_known=True, work=9) for rank in (0, 1)}
    )
    failures = hang_failures(watch, [0, 1], {})
    assert [failure.rank for failure in failures] == [0, 1]
    assert "no rank is behind the others" in failures[0].message


def test_ranks_that_all_wait_in_different_collectives_are_all_named_with_where_they_wait() -> None:
    watch = probed_watch(
        {
            0: protocol.Stacks(rank=0, stacks="", collective="gloo:broadcast #3", collectives_known=True),
            1: protocol.Stacks(rank=1, stacks="", collectives_known=True),
        }
    )
    failures = hang_failures(watch, [0, 1], {1: "report #2"})
    assert [failure.rank for failure in failures] == [0, 1]
    assert (
        "this one in gloo:broadcast #3; rank 0 waits in gloo:broadcast #3; rank 1 waits in report #2"
        in failures[0].message
    )


def test_ranks_are_listed_as_runs() -> None:
    assert ranks_text([9, 0, 2, 3, 4, 5]) == "0, 2-5, 9"


# -- real runs ------------------------------------------------------------------------------------


def train_steps(config: dict[str, Any]) -> None:
    """DDP steps on a small model. On rank ``stuck_rank`` (in the first attempt only), step
    ``stuck_at`` waits for a batch that never comes (an Event nobody sets), after writing the
    time to ``marker``. Rank 0 can pause before its first step (``pause_s``), sleep in the
    first step of every rank (``first_step_s``, as compilation would), and at step
    ``long_work_at`` save for ``save_s`` (its own code), validate for ``validate_s`` (forward
    passes) and report a checkpoint its ``checkpoint_upload_fn`` takes ``upload_s`` to upload,
    while the other ranks wait in that report."""
    rank = lockstep.get_context().get_world_rank()
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = prepare_data_loader(DataLoader(TensorDataset(torch.randn(4096, 16)), batch_size=8))
    start = 0
    if (checkpoint := lockstep.get_checkpoint()) is not None:
        with checkpoint.as_directory() as folder:
            start = int(Path(folder, "step").read_text()) + 1
    if rank == 0:
        time.sleep(config.get("pause_s", 0))
    for step, (inputs,) in zip(range(start, config["steps"]), loader, strict=False):  # the steps end it first
        if step == config.get("stuck_at") and rank == config.get("stuck_rank") and checkpoint is None:
            Path(config["marker"]).write_text(str(time.time()))
            threading.Event().wait()
        model(inputs).square().mean().backward()
        if step == 0:
            time.sleep(config.get("first_step_s", 0))
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(config.get("step_s", 0))
        if step == config.get("long_work_at"):
            long_work_on_rank_0(model, config) if rank == 0 else None
            report_checkpoint(step, config.get("upload_s", 0))
        elif step % 5 == 4:
            report_checkpoint(step) if step == config.get("checkpoint_at") else lockstep.report({"step": step})
    lockstep.report({"step": config["steps"] - 1, "done": True})


def long_work_on_rank_0(model: torch.nn.Module, config: dict[str, Any]) -> None:
    time.sleep(config.get("save_s", 0))  # writing a checkpoint with torch.save: the rank's own code, no progress
    ended = time.monotonic() + config.get("validate_s", 0)
    with torch.no_grad():
        while time.monotonic() < ended:  # validation: forward passes of the prepared model
            model(torch.randn(8, 16))


def report_checkpoint(step: int, upload_s: float = 0) -> None:
    def slow_upload(checkpoint: Checkpoint, dir_name: str) -> Checkpoint:
        time.sleep(upload_s)  # an upload to slow storage: lockstep's own long work, progress however long
        destination = Path(lockstep.get_context().get_storage().run_path, dir_name)
        shutil.copytree(checkpoint.path, destination, dirs_exist_ok=True)
        return Checkpoint(str(destination))

    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "step").write_text(str(step))
        lockstep.report(
            {"step": step},
            checkpoint=Checkpoint.from_directory(folder),
            checkpoint_upload_fn=slow_upload if upload_s else None,
        )


def fit(
    storage_path: str, workers: int, failure: FailureConfig, callbacks: list[Any] | None = None, **config: Any
) -> lockstep.Result:
    return TorchTrainer(
        train_steps,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(storage_path=storage_path, failure_config=failure, callbacks=callbacks or []),
    ).fit()


@pytest.mark.timeout(120)
def test_a_rank_stuck_in_its_data_loop_is_named_with_every_stack_within_the_threshold(
    storage_path: str, tmp_path: Path
) -> None:
    marker = tmp_path / "stuck_since"
    with pytest.raises(WorkerGroupError) as raised:
        fit(
            storage_path,
            3,
            FailureConfig(hang_timeout_s=2.0),
            steps=10_000,
            stuck_rank=1,
            stuck_at=30,
            marker=str(marker),
        )
    named_after_s = time.time() - float(marker.read_text())
    error = raised.value
    assert type(error) is WorkerGroupError and list(error.failures) == [1]
    assert error.failures[1].error_type == "Hang"
    message = str(error)
    assert "rank 1: Hang: no rank has made progress for" in message
    assert "this rank is in no collective while ranks 0, 2 wait in gloo:all_reduce #" in message
    assert "The hang threshold: 2 s = max(FailureConfig.hang_timeout_s=2" in message
    stacks = stacks_by_rank(message)
    assert sorted(stacks) == [0, 1, 2], message
    assert "in wait" in stacks[1] and "in train_steps" in stacks[1] and "in backward" not in stacks[1]
    for waiting in (0, 2):
        assert stacks[waiting].startswith("(waiting in torch collective gloo:all_reduce #")
        assert "in backward" in stacks[waiting] and "in train_steps" in stacks[waiting]
    # 2 s without progress, then up to PROBE_WAIT_S (3 s) for the answers and 2 s for the stacks, plus
    # the time to stop three processes and raise
    assert named_after_s < 2.0 + PROBE_WAIT_S + 2.0 + 3.0, f"named {named_after_s:.1f} s after rank 1 stopped"


class Failures(Callback):
    def __init__(self) -> None:
        self.errors: list[tuple[Exception, bool]] = []

    def on_failure(self, run: Any, error: Exception, restarting: bool) -> None:
        self.errors.append((error, restarting))


@pytest.mark.timeout(150)
def test_with_max_failures_a_hang_restarts_from_the_latest_checkpoint(storage_path: str, tmp_path: Path) -> None:
    failures = Failures()
    result = fit(
        storage_path,
        2,
        FailureConfig(max_failures=1, hang_timeout_s=2.0),
        callbacks=[failures],
        steps=20,
        checkpoint_at=9,
        stuck_rank=1,
        stuck_at=12,
        marker=str(tmp_path / "stuck_since"),
    )
    ((error, restarting),) = failures.errors
    assert restarting and isinstance(error, WorkerGroupError) and error.failures[1].error_type == "Hang"
    assert result.num_failures == 1 and result.metrics == {"step": 19, "done": True}
    steps = [row["step"] for row in result.metrics_history]
    assert steps == [4, 9, 14, 19, 19], "the second attempt resumed after step 9's checkpoint"


@pytest.mark.timeout(120)
def test_a_pause_before_the_first_step_and_a_slow_first_step_are_no_hang(storage_path: str) -> None:
    # After the first step the rule would fire on a step 3x the others (1 s, the floor, < the 3 s
    # first step), yet before it hang_first_step_timeout_s (15 s) holds: rank 0 pauses 3 s before
    # its first step while the other waits in its all-reduce, then every rank's first step takes
    # 3 s (30x the 0.1 s of the others)
    result = fit(
        storage_path,
        2,
        FailureConfig(hang_timeout_s=1.0, hang_step_multiple=3, hang_first_step_timeout_s=15),
        steps=12,
        pause_s=3.0,
        first_step_s=3.0,
        step_s=0.1,
    )
    assert result.metrics == {"step": 11, "done": True}


@pytest.mark.timeout(120)
def test_long_work_on_rank_0_while_the_others_wait_in_report_is_no_hang(storage_path: str) -> None:
    # A 3 s threshold: rank 0 saves for 1.5 s in its own code (as 40 s under the default 60 s;
    # its next progress reaches the driver up to 0.5 s later), validates for 4 s (forward passes:
    # progress), then its checkpoint upload takes 5 s (lockstep's own work: progress), while
    # the other rank waits in report()
    result = fit(
        storage_path,
        2,
        FailureConfig(hang_timeout_s=3.0),
        steps=10,
        long_work_at=4,
        save_s=1.5,
        validate_s=4.0,
        upload_s=5.0,
    )
    assert result.metrics == {"step": 9, "done": True} and result.checkpoint is not None


# -- progress that is not a training step (found in review) -------------------------------------


def test_a_rank_busy_past_the_busy_limit_is_due_and_a_finished_rank_is_no_longer_busy() -> None:
    clock = Clock()
    assert HangRule.from_config(FailureConfig(report_timeout_s=100.0)).busy_limit_s == 100.0
    watch = HangWatch(HangRule(timeout_s=5.0, busy_limit_s=100.0), clock)
    watch.progress(protocol.Progress(rank=0, work=10, steps=3, busy=True))
    clock.now += 99
    assert not watch.due(), "an upload within report_timeout_s is progress"
    clock.now += 1
    assert watch.due(), "an upload stuck past report_timeout_s is a hang"

    watch = HangWatch(HangRule(timeout_s=5.0), clock)
    watch.progress(protocol.Progress(rank=1, work=10, steps=3, busy=True))
    watch.rank_ended(1)  # its last word was "busy", then its train function ended
    clock.now += 5
    assert watch.due(), "a finished rank's last busy flag held the alarm off for the whole attempt"


def evaluate_beside_training(config: dict[str, Any]) -> None:
    """Rank 0 evaluates for ``eval_s`` through the model prepare_model returned (or, with
    ``inner``, through ``model.module``, as rank-0-only evaluation does), while any other rank
    waits in report()."""
    rank = lockstep.get_context().get_world_rank()
    model = prepare_model(torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 3 and rank == 0:
            network = model.module if config["inner"] else model
            end = time.monotonic() + config["eval_s"]
            with torch.no_grad():
                while time.monotonic() < end:
                    network(torch.randn(8, 16))
                    time.sleep(0.01)
        lockstep.report({"step": step})


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("workers", "inner"), [(1, False), (2, True)])
def test_evaluating_through_the_inner_or_unwrapped_model_is_no_hang(
    storage_path: str, workers: int, inner: bool
) -> None:
    result = TorchTrainer(
        evaluate_beside_training,
        train_loop_config={"inner": inner, "eval_s": 5.0},  # 2.5 times the threshold
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(storage_path=storage_path, failure_config=FailureConfig(hang_timeout_s=2.0)),
    ).fit()
    assert result.metrics == {"step": 5}


def validate_slowly(checkpoint: Checkpoint) -> dict[str, float]:
    time.sleep(5.0)  # 2.5 times the threshold
    return {"score": 1.0}


def wait_for_the_validation(config: dict[str, Any]) -> list[str]:
    for step in range(3):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            lockstep.report({"step": step}, checkpoint=Checkpoint.from_directory(folder), validation=step == 2)
    return [reported.status.value for reported in lockstep.get_all_reported_checkpoints()]  # waits for it


@pytest.mark.timeout(120)
def test_ranks_waiting_for_a_validation_are_no_hang(storage_path: str) -> None:
    from lockstep.validation import ValidationConfig

    result = TorchTrainer(
        wait_for_the_validation,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage_path, failure_config=FailureConfig(hang_timeout_s=2.0)),
        validation_config=ValidationConfig(validate_slowly),
    ).fit()
    assert result.return_value[-1] == "VALIDATED"


def upload_that_never_ends(checkpoint: Checkpoint, dir_name: str) -> Checkpoint:
    threading.Event().wait()  # a copy onto a hard-mounted NFS that went away
    raise AssertionError("unreachable")


def report_one_stuck_async_upload(config: dict[str, Any]) -> None:
    rank = lockstep.get_context().get_world_rank()
    for step in range(4):
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "step.txt").write_text(str(step))
            lockstep.report(
                {"step": step},
                checkpoint=Checkpoint.from_directory(folder) if step == 1 else None,
                checkpoint_upload_mode="ASYNC",
                checkpoint_upload_fn=upload_that_never_ends if rank == 0 else None,
            )


@pytest.mark.timeout(120)
def test_an_upload_stuck_past_report_timeout_s_is_named_as_a_hang(storage_path: str) -> None:
    started = time.monotonic()
    with pytest.raises(WorkerGroupError) as raised:
        TorchTrainer(
            report_one_stuck_async_upload,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(
                storage_path=storage_path, failure_config=FailureConfig(hang_timeout_s=2.0, report_timeout_s=4.0)
            ),
        ).fit()
    error = raised.value
    assert list(error.failures) == [0] and error.failures[0].error_type == "Hang", str(error)
    assert "in lockstep's own work (saving or uploading a checkpoint) for longer than" in str(error)
    assert "report_timeout_s=4 s" in str(error) and "upload_that_never_ends" in str(error)
    assert time.monotonic() - started < 60, "named long after report_timeout_s (4 s) and the probe (3 s)"


def test_the_lightning_strategies_count_each_step_as_progress() -> None:
    from lockstep._internal.rank.progress import PROGRESS
    from lockstep.lightning._classes import _LockstepParallel

    class Steps:
        def training_step(self, *args: Any, **kwargs: Any) -> str:
            return "trained"

        def validation_step(self, *args: Any, **kwargs: Any) -> str:
            return "validated"

        def test_step(self, *args: Any, **kwargs: Any) -> str:
            return "tested"

        def predict_step(self, *args: Any, **kwargs: Any) -> str:
            return "predicted"

    class Strategy(_LockstepParallel, Steps):
        pass

    strategy = object.__new__(Strategy)
    before = PROGRESS.work
    done = [strategy.training_step(1), strategy.validation_step(1), strategy.test_step(1), strategy.predict_step(1)]
    assert done == ["trained", "validated", "tested", "predicted"] and PROGRESS.work == before + 4
