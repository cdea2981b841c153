"""``lockstep run``'s exit (lockstep._internal.fast_exit): the script's threads, exit handlers and
open files end as under Python's own exit; only the collector's last walk is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO_ROOT

LOCKSTEP_COMMAND = str(Path(sys.executable).with_name("lockstep"))

SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys, threading, time

    class Holder:
        '''A reference cycle holding a file nobody closes: only a collection frees it.'''
        def __init__(self, path):
            self.me = self
            self.file = open(path, "w")
            self.marker_fd = os.open(path + ".collected", os.O_WRONLY | os.O_CREAT)
        def __del__(self):
            os.write(self.marker_fd, b"collected")

    holder = Holder(sys.argv[1])
    holder.file.write("written, never closed\\n")

    def after_the_script():
        time.sleep(0.2)  # still running when the script's last line is done
        with open(sys.argv[1] + ".thread", "w") as handle:
            handle.write("thread done\\n")

    threading.Thread(target=after_the_script).start()
    atexit.register(print, "exit handler ran")
    """
)


def run_script(tmp_path: Path, fast_exit: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"out_{fast_exit}"
    env = {**os.environ, "LOCKSTEP_WARM_START": "0", "LOCKSTEP_FAST_EXIT": fast_exit}
    completed = subprocess.run([LOCKSTEP_COMMAND, "run", str(script), str(out)], capture_output=True, text=True,
                               timeout=60, cwd=REPO_ROOT, env=env)
    return completed, out


@pytest.mark.timeout(120)
def test_the_fast_exit_skips_the_last_collection_and_keeps_threads_handlers_and_files(tmp_path: Path) -> None:
    completed, out = run_script(tmp_path, "1")
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == "exit handler ran\n"
    assert Path(f"{out}.thread").read_text() == "thread done\n"
    assert out.read_text() == "written, never closed\n"  # flushed before the collector was told to stop
    assert Path(f"{out}.collected").read_text() == ""  # the cycle was never collected: the walk was skipped


@pytest.mark.timeout(120)
def test_lockstep_fast_exit_0_keeps_python_s_own_exit(tmp_path: Path) -> None:
    completed, out = run_script(tmp_path, "0")
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == "exit handler ran\n"
    assert Path(f"{out}.thread").read_text() == "thread done\n"
    assert Path(f"{out}.collected").read_text() == "collected"  # Python's last collection freed the cycle
