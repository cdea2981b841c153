"""The start hook (lockstep._internal.start_hook, ``lockstep start-hook``): a .pth file that has
``python train.py`` start the warm process before the script's first line. Each test installs it
into a venv of its own, layered over this one, never into the venv the tests run in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import threading
from pathlib import Path

import pytest
import test_fast_exit

from lockstep._internal import start_hook

#: What a script's first line finds; its text does not name the package (the hook reads it).
FIRST_LINE = """\
import json, os, sys
children = open(f"/proc/self/task/{os.getpid()}/children").read().split()
print("FIRST", json.dumps({"early": "lock" "step" in sys.modules, "children": len(children)}))
"""

TRAINING_SCRIPT = (
    FIRST_LINE
    + """\
import torch
from lockstep.torch import TorchTrainer
from lockstep._internal.warm import warm_start
print("WARM", warm_start.warm_process_pid())
"""
)


def first_line(completed: subprocess.CompletedProcess[str]) -> dict:
    assert completed.returncode == 0, f"exit {completed.returncode}\n{completed.stdout}\n{completed.stderr}"
    return json.loads(completed.stdout.split("FIRST ", 1)[1].splitlines()[0])


class LayeredVenv:
    """A venv whose site-packages adds this one's (so lockstep and torch import there), with
    its own site-packages for the hook."""

    def __init__(self, root: Path, with_lockstep: bool = True) -> None:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=60)
        self.python = str(root / "bin" / "python")
        self.site_packages = subprocess.run(
            [self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
        if with_lockstep:  # "aaa": read before the hook's file, as an installed lockstep would be there
            ours = sysconfig.get_paths()["purelib"]
            Path(self.site_packages, "aaa-this-venv.pth").write_text(f"import site; site.addsitedir({ours!r})\n")

    def run(self, *arguments: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.python, *arguments], capture_output=True, text=True, timeout=90, env={**os.environ, **env}
        )


@pytest.fixture
def venv(tmp_path: Path) -> LayeredVenv:
    return LayeredVenv(tmp_path / "venv")


def test_the_pth_file_is_one_line_python_executes() -> None:
    text = start_hook.pth_text()
    assert text.count("\n") == 1 and text.endswith("\n") and text.startswith("import ")


@pytest.mark.timeout(180)
def test_installed_it_starts_the_warm_process_before_the_script_s_first_line(venv: LayeredVenv, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT)
    assert first_line(venv.run(str(script))) == {"early": False, "children": 0}
    installed = venv.run("-m", "lockstep.cli", "start-hook", "install")
    assert installed.returncode == 0 and installed.stdout.strip().endswith(start_hook.PTH_NAME), installed.stderr
    assert venv.run("-m", "lockstep.cli", "start-hook").stdout.startswith("installed: ")
    completed = venv.run(str(script))
    assert first_line(completed) == {"early": True, "children": 1}  # the warm process, already
    assert completed.stdout.split("WARM ", 1)[1].split()[0] != "None"
    off = venv.run(str(script), LOCKSTEP_WARM_START="0")  # lockstep imported early, but no warm process
    assert first_line(off) == {"early": True, "children": 0}
    removed = venv.run("-m", "lockstep.cli", "start-hook", "remove")
    assert removed.stdout.startswith("removed "), removed.stderr
    assert first_line(venv.run(str(script))) == {"early": False, "children": 0}
    assert venv.run("-m", "lockstep.cli", "start-hook", "remove").stdout.startswith("no start hook at ")


@pytest.mark.timeout(120)
def test_other_starts_import_nothing_early(venv: LayeredVenv, tmp_path: Path) -> None:
    start_hook.install(venv.site_packages)
    plain = tmp_path / "plain.py"
    plain.write_text(FIRST_LINE)  # names no lockstep
    assert first_line(venv.run(str(plain))) == {"early": False, "children": 0}
    assert first_line(venv.run("-c", FIRST_LINE)) == {"early": False, "children": 0}
    (tmp_path / "lockstep").mkdir()  # a lockstep of the script's own beside it: the script's import decides
    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT.replace("import torch\n", "import torch\nsys.exit(0)\n"))
    assert first_line(venv.run(str(script))) == {"early": False, "children": 0}


@pytest.mark.timeout(120)
def test_a_hook_left_behind_by_a_removed_lockstep_is_silent(tmp_path: Path) -> None:
    bare = LayeredVenv(tmp_path / "bare", with_lockstep=False)
    start_hook.install(bare.site_packages)
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('lockstep' in sys.modules)\n")  # names it: the hook tries
    completed = bare.run(str(script))
    assert (completed.returncode, completed.stdout, completed.stderr) == (0, "False\n", "")


def test_status_tells_an_outdated_hook(tmp_path: Path) -> None:
    assert start_hook.hook_state(str(tmp_path)) == "absent"
    start_hook.install(str(tmp_path))
    assert start_hook.hook_state(str(tmp_path)) == "installed"
    start_hook.hook_path(str(tmp_path)).write_text("import sys\n")
    assert start_hook.hook_state(str(tmp_path)) == "outdated"
    assert start_hook.remove(str(tmp_path)) == tmp_path / start_hook.PTH_NAME
    assert start_hook.remove(str(tmp_path)) is None


@pytest.mark.timeout(120)
def test_a_script_read_from_a_pipe_is_left_to_python(venv: LayeredVenv, tmp_path: Path) -> None:
    start_hook.install(venv.site_packages)
    pipe = tmp_path / "piped.py"
    os.mkfifo(pipe)
    source = "import sys\nprint('ran', 'lock' 'step' in sys.modules)  # lockstep\n"
    writer = threading.Thread(target=pipe.write_text, args=(source,), daemon=True)
    writer.start()
    try:
        completed = venv.run(str(pipe))  # the hook must not drain the pipe before Python reads it
    finally:
        if writer.is_alive():  # Python never opened it: unblock the writer
            with open(pipe, "rb"):
                pass
        writer.join(10)
    assert (completed.returncode, completed.stdout) == (0, "ran False\n"), completed.stderr


def run_hooked(
    venv: LayeredVenv, tmp_path: Path, text: str, fast_exit: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run ``text`` (one of test_fast_exit's scripts) as ``python job.py OUT`` with the hook installed."""
    start_hook.install(venv.site_packages)
    script = tmp_path / "job.py"
    script.write_text("# started with lockstep's start hook\n" + textwrap.dedent(text))
    out = tmp_path / f"out_{fast_exit}"
    completed = venv.run(str(script), str(out), LOCKSTEP_WARM_START="0", LOCKSTEP_FAST_EXIT=fast_exit)
    assert "Exception ignored" not in completed.stderr, completed.stderr
    return completed, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("fast_exit", "ending"), [("1", "exit"), ("1", "raise"), ("0", "exit")])
def test_a_hooked_script_ends_as_under_python_s_own_exit(
    venv: LayeredVenv, tmp_path: Path, fast_exit: str, ending: str
) -> None:
    text = (
        test_fast_exit.SCRIPT if ending == "exit" else test_fast_exit.SCRIPT.replace("sys.exit(3)", "raise OSError(5)")
    )
    completed, out = run_hooked(venv, tmp_path, text, fast_exit)
    assert completed.returncode == (3 if ending == "exit" else 1), completed.stderr
    assert ending == "exit" or completed.stderr.rstrip().endswith("OSError: 5"), completed.stderr
    assert completed.stdout == "exit handler ran\n"
    assert Path(f"{out}.thread").read_text() == "thread done\n"
    assert out.read_text() == "written, never closed\n"
    assert Path(f"{out}.cycle").read_text() == "finalized"
    assert Path(f"{out}.plain").read_text() == "finalized"  # also when a traceback held the script's frames


@pytest.mark.timeout(120)
def test_a_hooked_script_gets_lockstep_run_s_exit(venv: LayeredVenv, tmp_path: Path) -> None:
    fast, out = run_hooked(venv, tmp_path, test_fast_exit.HELD_BY_A_PACKAGE, "1")
    assert fast.returncode == 0, fast.stderr
    assert Path(f"{out}.package").read_text() == ""  # frozen, not torn down: the fast exit ran
    own, out = run_hooked(venv, tmp_path, test_fast_exit.HELD_BY_A_PACKAGE, "0")
    assert own.returncode == 0, own.stderr
    assert Path(f"{out}.package").read_text() == "finalized"
