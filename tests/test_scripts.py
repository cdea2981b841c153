"""Whole scripts run as a user runs them: `python script.py` in a subprocess."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

SCRIPTS = Path(__file__).parent / "scripts"


def run_script(args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, f"exit {completed.returncode}\n{completed.stdout}\n{completed.stderr}"
    return completed


@pytest.mark.timeout(120)
def test_script_without_main_guard_runs_once(tmp_path: Path) -> None:
    runs_file = tmp_path / "runs.txt"
    completed = run_script(
        [str(SCRIPTS / "no_main_guard.py"), str(tmp_path / "results")], 110, SCRIPT_RUNS_FILE=str(runs_file)
    )
    metrics = json.loads(completed.stdout.split("RESULT ", 1)[1])
    assert metrics["epoch"] == 1 and metrics["world"] == 2
    assert len(runs_file.read_text().splitlines()) == 1, "the script body ran again in a worker"


@pytest.mark.timeout(120)
def test_script_failure_shows_the_script_path_and_line(tmp_path: Path) -> None:
    script = SCRIPTS / "no_main_guard.py"
    completed = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "results")],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "SCRIPT_RUNS_FILE": str(tmp_path / "runs"), "FAIL_IN_TRAIN": "rank code"},
        cwd=REPO_ROOT,
    )
    assert completed.returncode != 0
    assert "WorkerGroupError: Training failed on rank" in completed.stderr
    assert f'File "{script}", line' in completed.stderr, completed.stderr
    assert 'raise RuntimeError("failing on purpose in " + os.environ["FAIL_IN_TRAIN"])' in completed.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "example, expected",
    [
        ("fashion_mnist_mlp.py", "Last result: {'epoch': 0"),
        ("fashion_mnist_resnet18.py", "Test accuracy: "),
    ],
)
def test_example_on_a_subset(example: str, expected: str, tmp_path: Path, data_dir: Path) -> None:
    plot = tmp_path / "curves.png"
    completed = run_script(
        [
            str(REPO_ROOT / "examples" / example),
            "--smoke-test",
            "--epochs",
            "1",
            "--num-workers",
            "2",
            "--data-dir",
            str(data_dir),
            "--storage-path",
            str(tmp_path / "results"),
            "--name",
            "example",
            "--plot",
            str(plot),
        ],
        230,
    )
    assert expected in completed.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "results" / "example" / "lockstep_run.json").read_text())
    assert record["status"] == "finished" and record["num_reports"] == 1


@pytest.mark.timeout(120)
def test_workers_die_with_a_killed_driver_and_the_run_resumes(tmp_path: Path) -> None:
    import signal
    import time

    from conftest import tagged_processes, tagged_processes_after, wait_for_first_report

    script, results, stop_file = (
        str(SCRIPTS / "report_then_train_forever.py"),
        str(tmp_path / "results"),
        tmp_path / "stop",
    )
    reports = tmp_path / "results" / "forever" / "reports.jsonl"
    driver = subprocess.Popen([sys.executable, script, results, str(stop_file)])
    try:
        wait_for_first_report(reports, driver)
        assert len(tagged_processes()) >= 3  # the driver and its two workers
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert tagged_processes_after(time.monotonic() + 10) == [], "workers outlived their driver"

    stop_file.write_text("stop")
    completed = run_script([script, results, str(stop_file)], 100)
    assert "REPORTS [0, 1]" in completed.stdout
    assert "Continuing run" in completed.stderr


@pytest.mark.timeout(120)
def test_ctrl_c_stops_workers_and_marks_the_run_interrupted(tmp_path: Path) -> None:
    import signal
    import time

    from conftest import sigint_raises, tagged_processes_after

    run = tmp_path / "results" / "forever"
    driver = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "report_then_train_forever.py"), str(tmp_path / "results")],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_raises,
    )
    try:
        deadline = time.monotonic() + 90
        while not (run / "reports.jsonl").exists() or not (run / "reports.jsonl").read_text().endswith("\n"):
            assert driver.poll() is None and time.monotonic() < deadline, "the run never reported"
            time.sleep(0.05)
        interrupted_at = time.monotonic()
        driver.send_signal(signal.SIGINT)
        _, stderr = driver.communicate(timeout=30)
    finally:
        driver.kill()
        driver.wait()
    assert driver.returncode != 0
    assert "KeyboardInterrupt" in stderr
    assert tagged_processes_after(interrupted_at + 5) == [], "workers still running 5 s after Ctrl-C"
    assert json.loads((run / "lockstep_run.json").read_text())["status"] == "interrupted"


@pytest.mark.timeout(150)
def test_seed_003_script_runs_after_an_import_swap(tmp_path: Path, data_dir: Path) -> None:
    completed = run_script(
        [str(SCRIPTS / "seed_003_lockstep.py"), "--num-workers", "2", "--address", "none"],
        140,
        LOCKSTEP_DATA=str(data_dir),
        HOME=str(tmp_path),
    )
    assert "Test Error:" in completed.stdout and "Accuracy:" in completed.stdout
    assert "Last result: {'loss': " in completed.stdout
    runs = list((tmp_path / "lockstep_results").iterdir())
    assert len(runs) == 1 and runs[0].name.startswith("TorchTrainer_")


@pytest.mark.timeout(120)
def test_progress_line_in_a_pipe_is_plain_lines(tmp_path: Path) -> None:
    script = str(SCRIPTS / "progress_job.py")
    completed = run_script([script, str(tmp_path / "a")], 100)
    lines = completed.stderr.splitlines()
    assert "lockstep progress | report 0 | " in lines[0] and "2/2 workers | step=0 loss=1" in lines[0]
    assert lines[-1].startswith("lockstep progress | report 2 | ") and lines[-1].endswith(
        "step=2 loss=0.3333 | finished"
    )
    assert "\r" not in completed.stderr
    assert completed.stdout.splitlines() == ["rank 0 says 0", "rank 0 says 1", "rank 0 says 2"]
    quiet = run_script([script, str(tmp_path / "b"), "0"], 100)
    assert "lockstep progress" not in quiet.stderr


@pytest.mark.timeout(120)
def test_progress_line_on_a_terminal_updates_in_place_around_worker_output(tmp_path: Path) -> None:
    text = _run_on_a_terminal([str(SCRIPTS / "progress_job.py"), str(tmp_path)])
    assert "\rlockstep progress | report 1 | " in text and "\x1b[K" in text
    for step in range(3):  # on a wiped line, or after other worker output (lines may come in one write)
        before = text[: text.index(f"rank 0 says {step}\r\n")]
        assert before.endswith(("\r\x1b[K", "\r\n")), f"worker output is not written on a wiped line: {text!r}"
    assert text.rstrip().endswith("step=2 loss=0.3333 | finished\x1b[K")


@pytest.mark.timeout(120)
def test_on_a_terminal_log_lines_never_land_on_the_progress_line(tmp_path: Path) -> None:
    script = str(SCRIPTS / "progress_job.py")
    with_logging = (
        "import logging, runpy, sys; logging.basicConfig(level=logging.INFO, format='LOG %(message)s'); "
        f"sys.argv = [{script!r}, {str(tmp_path)!r}]; runpy.run_path({script!r}, run_name='__main__')"
    )
    text = _run_on_a_terminal(["-c", with_logging])
    assert "LOG Run progress: 2 workers" in text, "logging is on"
    assert "report #" not in text, "on a terminal the progress line is the account of each report"
    assert "\rlockstep progress | report 2 | " in text
    for line in text.split("\n"):
        shown = as_shown(line)
        assert "LOG " not in shown or shown.startswith("LOG "), f"a log record shares a line: {line!r} shows {shown!r}"


def as_shown(line: str) -> str:
    """What a terminal shows for one line of output: a carriage return goes back to the start of
    the line and overwrites it; ESC[K clears the rest of it."""
    screen = ""
    for segment in line.split("\r"):
        cleared = segment.startswith("\x1b[K")
        segment = segment.replace("\x1b[K", "")
        screen = segment if cleared else segment + screen[len(segment) :]
    return screen


def _run_on_a_terminal(args: list[str]) -> str:
    """Run ``python *args`` with a pseudo-terminal as stdout and stderr; what it wrote."""
    import pty

    main_end, terminal = pty.openpty()
    process = subprocess.Popen([sys.executable, *args], stdout=terminal, stderr=terminal, cwd=REPO_ROOT)
    os.close(terminal)
    screen = b""
    while chunk := _read_or_empty(main_end):
        screen += chunk
    os.close(main_end)
    assert process.wait(timeout=100) == 0, screen.decode(errors="replace")
    return screen.decode()


def _read_or_empty(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except OSError:  # the terminal's other end closed
        return b""


def torchrun(*args: str, timeout: float = 110) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


def rank_results(stdout: str) -> dict[int, dict]:
    found = {}
    for line in stdout.splitlines():
        if line.startswith("RANK "):
            _, rank, _, pid, _, summary = line.split(" ", 5)
            found[int(rank)] = {"pid": int(pid), **json.loads(summary)}
    return found


def assert_every_rank_got_rank_0s_result(ranks: dict[int, dict]) -> None:
    """Each rank's fit() returned a Result of the same run: same folder, metrics, checkpoints,
    history (the return value is rank 0's own)."""
    assert sorted(ranks) == [0, 1], "every rank's fit() must return"
    compared = (
        "path",
        "metrics",
        "checkpoint",
        "checkpoint_files",
        "best_checkpoints",
        "history",
        "num_failures",
        "error",
    )
    for key in compared:
        assert ranks[1][key] == ranks[0][key], f"rank 1's Result.{key} differs from rank 0's"
    assert ranks[0]["error"] is None and ranks[0]["checkpoint"] is not None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


JOB = str(SCRIPTS / "torchrun_job.py")


@pytest.mark.timeout(150)
def test_under_torchrun_the_train_function_runs_in_torchrun_processes(tmp_path: Path) -> None:
    completed = torchrun(
        "--max-restarts=0",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "--rdzv_id=job42",
        JOB,
        str(tmp_path),
        "--default-name",
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    ranks = rank_results(completed.stdout)
    assert_every_rank_got_rank_0s_result(ranks)
    assert ranks[0]["metrics"]["pids"] == [ranks[0]["pid"], ranks[1]["pid"]], (
        "the train function ran in other processes"
    )
    assert ranks[0]["metrics"]["step"] == 1 and ranks[0]["metrics"]["sum"] == 2.0
    assert ranks[0]["checkpoint_files"] == {"rank0.txt": "1", "rank1.txt": "1"}
    assert ranks[0]["return_value"] == ranks[0]["pid"]
    assert [row[:2] for row in ranks[0]["history"]] == [[0, 0], [1, 1]]
    assert Path(ranks[0]["path"]) == tmp_path / "TorchTrainer_job42", "the run is named after torchrun's run id"
    record = json.loads((tmp_path / "TorchTrainer_job42" / "lockstep_run.json").read_text())
    assert record["status"] == "finished" and record["executor"] == "external"


@pytest.mark.timeout(150)
def test_under_torchrun_without_a_run_id_every_rank_uses_rank_0s_run_name(tmp_path: Path) -> None:
    # torchrun's static rendezvous gives no run id (TORCHELASTIC_RUN_ID=none), as a plain launcher would
    completed = torchrun(
        "--max-restarts=0",
        "--rdzv_backend=static",
        f"--master_port={free_port()}",
        JOB,
        str(tmp_path),
        "--default-name",
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    ranks = rank_results(completed.stdout)
    assert_every_rank_got_rank_0s_result(ranks)
    (run,) = tmp_path.iterdir()
    assert Path(ranks[0]["path"]) == run
    assert re.fullmatch(r"TorchTrainer_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{4}", run.name), run.name


@pytest.mark.timeout(150)
def test_under_torchrun_a_wrong_num_workers_is_refused(tmp_path: Path) -> None:
    completed = torchrun("--max-restarts=0", JOB, str(tmp_path), "--num-workers", "3")
    assert completed.returncode != 0
    assert "ScalingConfig(num_workers=3)" in completed.stderr and "num_workers must be 2" in completed.stderr


@pytest.mark.timeout(200)
def test_under_torchrun_a_restarted_group_continues_the_run(tmp_path: Path) -> None:
    completed = torchrun("--max-restarts=1", JOB, str(tmp_path), "--fail-once", timeout=190)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "rank 1 fails once on purpose" in completed.stderr
    ranks = rank_results(completed.stdout)
    assert_every_rank_got_rank_0s_result(ranks)
    # rank 1 failed before report 2, so step 1's checkpoint was the latest: both ranks resumed from it
    assert ranks[0]["history"] == [[0, 0, None], [1, 1, None], [2, 2, 1], [3, 3, 1]]
    assert ranks[0]["metrics"]["step"] == 3 and ranks[0]["metrics"]["resumed_from"] == 1
    assert ranks[0]["checkpoint_files"] == {"rank0.txt": "3", "rank1.txt": "3"}
    history = [
        json.loads(line)["metrics"]["step"]
        for line in (tmp_path / "torchrun" / "reports.jsonl").read_text().splitlines()
    ]
    assert history == [0, 1, 2, 3]


@pytest.mark.timeout(150)
def test_under_torchrun_a_hung_rank_is_named_with_where_every_rank_is(tmp_path: Path) -> None:
    completed = torchrun("--max-restarts=0", JOB, str(tmp_path), "--hang")
    assert completed.returncode != 0
    record = json.loads((tmp_path / "torchrun" / "lockstep_run.json").read_text())
    assert record["status"] == "failed"
    # rank 0's fit() raises the run's error (torchrun shows its stderr, each line headed "[rank0]: ")
    stderr = "\n".join(line.removeprefix("[rank0]: ") for line in completed.stderr.splitlines())
    error = stderr[stderr.index("Training failed on rank 1") :]
    assert "rank 1: Hang: no rank has made progress for" in error
    assert "this rank is in no collective while rank 0 waits in report #2" in error
    # the stacks come from the ranks themselves (torchrun's processes can't be signalled from rank 0)
    stack_of_0 = error.split("rank 0 was still running, here:\n")[1].split("\n\nrank 1 was")[0]
    stack_of_1 = error.split("rank 1 was still running, here:\n")[1]
    assert stack_of_0.startswith("Thread MainThread (most recent call last):") and "lockstep.report(" in stack_of_0
    assert stack_of_1.startswith("Thread MainThread (most recent call last):")
    assert "in train_func" in stack_of_1 and "in wait" in stack_of_1
