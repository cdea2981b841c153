"""The suite's own rules, checked on a small suite run by a real pytest with this conftest: under
``CI=true`` only GPU tests skip (a missing package or fixture resource is an error), and the
closing line counts GPU skips apart; and the torch the tests run on is the floor the package
declares."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO_ROOT

SMALL_SUITE = """
import pytest

def test_runs():
    pass

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_on_a_gpu():
    pass

def test_needs_a_tool():
    pytest.skip("the tool is not installed")
"""

MISSING_PACKAGE = """
import pytest

pytest.importorskip("lockstep_no_such_package")

def test_never_collected():
    pass
"""


def run_small_suite(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_small.py").write_text(SMALL_SUITE)
    (tmp_path / "test_missing.py").write_text(MISSING_PACKAGE)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "tests"), "CI": "true" if ci else "false"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "conftest",
            "-c",
            os.devnull,
            "--rootdir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            "-o",
            "markers=gpu",
            "--continue-on-collection-errors",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.timeout(150)
def test_under_ci_only_gpu_tests_may_skip(tmp_path: Path) -> None:
    completed = run_small_suite(tmp_path, ci=True)
    closing = completed.stdout.strip().splitlines()[-1]
    assert completed.returncode == 1, completed.stdout
    assert re.search(r"1 failed, 1 passed, 1 error, 1 skipped \(no GPU\) in ", closing), closing
    assert "test_needs_a_tool would be skipped (the tool is not installed)" in completed.stdout
    assert (
        "every test of test_missing.py would be skipped (could not import 'lockstep_no_such_package'"
        in completed.stdout
    )


@pytest.mark.timeout(150)
def test_outside_ci_skips_stay_skips(tmp_path: Path) -> None:
    completed = run_small_suite(tmp_path, ci=False)
    closing = completed.stdout.strip().splitlines()[-1]
    assert completed.returncode == 0, completed.stdout
    assert re.search(r"1 passed, 2 skipped, 1 skipped \(no GPU\)", closing), closing


def test_the_tests_run_on_the_torch_floor_the_package_declares() -> None:
    requirement = next(line for line in metadata.requires("lockstep") or [] if re.match(r"torch\b", line))
    floor = re.search(r">=\s*([0-9.]+)", requirement)
    assert floor is not None, f"lockstep's torch requirement {requirement!r} names no floor"
    installed = metadata.version("torch").split("+")[0]
    assert installed.split(".")[:2] == floor.group(1).split(".")[:2], (
        f"the tests run on torch {installed}, but the package allows torch {floor.group(1)}: CI must test the floor"
    )
