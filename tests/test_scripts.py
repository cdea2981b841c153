"""Whole scripts run as a user runs them: `python script.py` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

SCRIPTS = Path(__file__).parent / "scripts"


def run_script(args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **env}, cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, f"exit {completed.returncode}\n{completed.stdout}\n{completed.stderr}"
    return completed


@pytest.mark.timeout(120)
def test_script_without_main_guard_runs_once(tmp_path: Path) -> None:
    runs_file = tmp_path / "runs.txt"
    completed = run_script([str(SCRIPTS / "no_main_guard.py"), str(tmp_path / "results")], 110,
                           SCRIPT_RUNS_FILE=str(runs_file))
    metrics = json.loads(completed.stdout.split("RESULT ", 1)[1])
    assert metrics["epoch"] == 1 and metrics["world"] == 2
    assert len(runs_file.read_text().splitlines()) == 1, "the script body ran again in a worker"
