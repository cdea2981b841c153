"""The `lockstep` command on real runs, in local storage and on a local S3 server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import lockstep
from lockstep import RunConfig, TrainingFailedError, cli
from lockstep.torch import TorchTrainer


def three_reports() -> None:
    for step in range(3):
        lockstep.report({"step": step, "loss": 1.0 / (step + 1), "note": "text"})


def fail_after_one_report() -> None:
    lockstep.report({"step": 0, "loss": 2.0})
    raise RuntimeError("failing on purpose for the CLI test")


def make_runs(storage: str) -> None:
    TorchTrainer(three_reports, run_config=RunConfig(name="good", storage_path=storage)).fit()
    with pytest.raises(TrainingFailedError):
        TorchTrainer(fail_after_one_report, run_config=RunConfig(name="bad", storage_path=storage)).fit()


def lockstep_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lockstep.cli", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory: pytest.TempPathFactory) -> str:
    storage = str(tmp_path_factory.mktemp("cli") / "results")
    make_runs(storage)
    return storage


def test_runs_lists_each_run_with_status_reports_and_last_metrics(local_runs: str) -> None:
    listed = lockstep_cli("runs", local_runs)
    assert listed.returncode == 0, listed.stderr
    header, good, bad = listed.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "STATUS", "REPORTS"]
    assert good.split()[:3] == ["good", "finished", "3"] and "loss=0.3333" in good
    assert bad.split()[:3] == ["bad", "failed", "1"]


def test_show_prints_the_metrics_table_and_the_failure(local_runs: str) -> None:
    shown = lockstep_cli("show", "good", "--storage", local_runs)
    assert shown.returncode == 0, shown.stderr
    assert "status:       finished" in shown.stdout and "1 (local executor)" in shown.stdout
    table = shown.stdout.split("\n\n")[1].splitlines()
    assert table[0].split() == ["step", "loss", "note", "report_index"]
    assert [line.split()[0] for line in table[1:]] == ["0", "1", "2"]
    failed = lockstep_cli("show", str(Path(local_runs, "bad")))
    assert "status:       failed" in failed.stdout and "failing on purpose for the CLI test" in failed.stdout


def test_plot_draws_the_chosen_metrics(local_runs: str, tmp_path: Path) -> None:
    output = tmp_path / "curves.png"
    drawn = lockstep_cli("plot", "good", "--storage", local_runs, "-m", "loss", "-o", str(output))
    assert drawn.returncode == 0, drawn.stderr
    assert "loss" in drawn.stdout and output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refused = lockstep_cli("plot", "good", "--storage", local_runs, "-m", "accuracy", "-o", str(output))
    assert refused.returncode == 2 and "it has: step, loss" in refused.stderr


def test_plot_without_matplotlib_says_what_to_install(
    local_runs: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    status = cli.main(["plot", "good", "--storage", local_runs, "-o", str(tmp_path / "curves.png")])
    printed = capsys.readouterr()
    assert status == 2 and printed.out == ""
    assert "matplotlib, which is not installed" in printed.err and "pip install matplotlib" in printed.err
    assert "Traceback" not in printed.err and not (tmp_path / "curves.png").exists()


def test_unknown_storage_and_run_are_clear_errors(tmp_path: Path) -> None:
    missing = lockstep_cli("runs", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "is not a folder" in missing.stderr
    unknown = lockstep_cli("show", "nope", "--storage", str(tmp_path))
    assert unknown.returncode == 2 and "no lockstep run at 'nope'" in unknown.stderr


@pytest.mark.timeout(120)
def test_runs_show_and_plot_work_on_s3(s3_env: dict[str, str], tmp_path: Path) -> None:
    make_runs("s3://runs/cli")
    listed = lockstep_cli("runs", "s3://runs/cli")
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[:2] for line in listed.stdout.splitlines()[1:]] == [["good", "finished"], ["bad", "failed"]]
    assert "s3://runs/cli/good" in listed.stdout
    assert "loss" in lockstep_cli("show", "s3://runs/cli/good").stdout
    drawn = lockstep_cli("plot", "good", "--storage", "s3://runs/cli", "-o", str(tmp_path / "s3.png"))
    assert drawn.returncode == 0, drawn.stderr
    assert "step, loss" in drawn.stdout


def test_lockstep_run_passes_the_scripts_arguments_as_given() -> None:
    from lockstep.cli import _script_arguments

    assert _script_arguments(["run", "train.py", "--", "x"]) == ["--", "x"]  # python train.py -- x keeps "--"
    assert _script_arguments(["run", "train.py", "--lr", "0.1"]) == ["--lr", "0.1"]
    assert _script_arguments(["run", "train.py"]) == []
    assert _script_arguments(["run", "--", "args.py", "1"]) == ["1"]


def test_nested_metrics_are_plotted_and_charted_by_their_path() -> None:
    from lockstep._internal.console_lines import shown_lines
    from lockstep.callbacks import numeric_metrics

    reported = {"val": {"loss": 0.5, "note": "x"}, "done": True, "step": 3}
    assert numeric_metrics(reported) == {"val/loss": 0.5, "step": 3.0}
    assert shown_lines("epoch 1\n10%\r50%\r100%\ndone\rdone!\r\n") == ["epoch 1", "100%", "done!"]
