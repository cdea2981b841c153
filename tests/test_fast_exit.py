"""``lockstep run``'s exit (lockstep._internal.fast_exit): the script's threads, exit handlers,
exit status, open files and finalizers end as under Python's own exit; what an installed package
holds is frozen instead of torn down."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO_ROOT

LOCKSTEP_COMMAND = str(Path(sys.executable).with_name("lockstep"))

MARKERS = """
import atexit, json, os, sys, threading, time

class Marked:
    # Writes 'finalized' into its file when finalized (with the module's globals still set).
    def __init__(self, path, cycle=False):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        self.me = self if cycle else None
    def __del__(self):
        os.write(self.fd, b"finalized")
"""

SCRIPT = (
    MARKERS
    + """
class Holder:
    # A reference cycle holding a file nobody closes: only a collection frees it.
    def __init__(self, path):
        self.me = self
        self.file = open(path, "w")
        self.marker = Marked(path + ".cycle")

holder = Holder(sys.argv[1])
holder.file.write("written, never closed\\n")
plain = Marked(sys.argv[1] + ".plain")

def after_the_script():
    time.sleep(0.2)  # still running when the script's last line is done
    with open(sys.argv[1] + ".thread", "w") as handle:
        handle.write("thread done\\n")

threading.Thread(target=after_the_script).start()
atexit.register(print, "exit handler ran")
sys.exit(3)
"""
)

HELD_BY_A_PACKAGE = (
    MARKERS
    + """
class Kept(Marked):
    # Needs no global to be finalized: a package's teardown may have cleared this module by then.
    def __init__(self, path):
        super().__init__(path, cycle=True)
        self.write = os.write
    def __del__(self):
        self.write(self.fd, b"finalized")

json.kept_by_a_package = Kept(sys.argv[1] + ".package")  # only json's teardown drops it
"""
)


def run_script(tmp_path: Path, text: str, fast_exit: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(text))
    out = tmp_path / f"out_{fast_exit}"
    env = {**os.environ, "LOCKSTEP_WARM_START": "0", "LOCKSTEP_FAST_EXIT": fast_exit}
    completed = subprocess.run(
        [LOCKSTEP_COMMAND, "run", str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=env,
    )
    assert "Exception ignored" not in completed.stderr, completed.stderr
    return completed, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fast_exit", ["1", "0"])
def test_the_script_ends_as_under_python_s_own_exit(tmp_path: Path, fast_exit: str) -> None:
    completed, out = run_script(tmp_path, SCRIPT, fast_exit)
    assert completed.returncode == 3, completed.stderr
    assert completed.stdout == "exit handler ran\n"
    assert Path(f"{out}.thread").read_text() == "thread done\n"
    assert out.read_text() == "written, never closed\n"
    assert Path(f"{out}.cycle").read_text() == "finalized"  # the script's cycle was collected
    assert Path(f"{out}.plain").read_text() == "finalized"


@pytest.mark.timeout(120)
def test_what_an_installed_package_holds_is_frozen_not_torn_down(tmp_path: Path) -> None:
    fast, out = run_script(tmp_path, HELD_BY_A_PACKAGE, "1")
    assert fast.returncode == 0, fast.stderr
    assert Path(f"{out}.package").read_text() == ""  # the collector's last walks were skipped
    own, out = run_script(tmp_path, HELD_BY_A_PACKAGE, "0")
    assert own.returncode == 0, own.stderr
    assert Path(f"{out}.package").read_text() == "finalized"  # Python's teardown collected it


@pytest.mark.timeout(120)
def test_a_daemon_thread_running_the_script_s_code_keeps_python_s_own_exit(tmp_path: Path) -> None:
    own_code = HELD_BY_A_PACKAGE + "\ndef wait_forever():\n    threading.Event().wait()\n"
    own_code += "\nthreading.Thread(target=wait_forever, daemon=True).start()\n"
    (tmp_path / "own").mkdir()
    completed, out = run_script(tmp_path / "own", own_code, "1")
    assert completed.returncode == 0, completed.stderr
    assert Path(f"{out}.package").read_text() == "finalized"  # the step was skipped: Python tore json down
    library_code = HELD_BY_A_PACKAGE + "\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n"
    (tmp_path / "library").mkdir()
    completed, out = run_script(tmp_path / "library", library_code, "1")
    assert completed.returncode == 0, completed.stderr
    assert Path(f"{out}.package").read_text() == ""  # a thread in the standard library's code does not skip it


# -- found in review ---------------------------------------------------------------------------

ZIP_IN_A_CYCLE = """
import atexit, sys, zipfile

class Recorder:
    # A cycle (its bound method in its own list) holding an open zip file: closed by a collection.
    def __init__(self, path):
        self.archive = zipfile.ZipFile(path, "w")
        self.hooks = [self.record]
    def record(self, text):
        self.archive.writestr("metrics.txt", text)

recorder = Recorder(sys.argv[1])
recorder.record("loss=0.1")
atexit.register(lambda: None)  # the script's function, held by atexit: its globals get cleared
"""

LOGGING_HANDLER = """
import json, logging, sys

class JsonFileHandler(logging.Handler):
    # Writes its records when closed (by logging's shutdown), with the script's json.
    def __init__(self, path):
        super().__init__()
        self.path, self.records = path, []
    def emit(self, record):
        self.records.append(record.getMessage())
    def close(self):
        with open(self.path, "w") as handle:
            handle.write(json.dumps(self.records))
        super().close()

log = logging.getLogger("job")
log.addHandler(JsonFileHandler(sys.argv[1]))
log.warning("hello")
"""


@pytest.mark.timeout(120)
def test_a_cycle_the_clearing_releases_is_collected_and_logging_shuts_down_first(tmp_path: Path) -> None:
    import json
    import zipfile

    (tmp_path / "zip").mkdir()
    completed, out = run_script(tmp_path / "zip", ZIP_IN_A_CYCLE, "1")
    assert completed.returncode == 0, completed.stderr
    with zipfile.ZipFile(out) as archive:
        assert archive.read("metrics.txt") == b"loss=0.1"  # closed: its central directory was written
    (tmp_path / "log").mkdir()
    completed, out = run_script(tmp_path / "log", LOGGING_HANDLER, "1")
    assert completed.returncode == 0, completed.stderr
    assert json.loads(out.read_text()) == ["hello"]


@pytest.mark.timeout(120)
def test_a_daemon_thread_started_through_a_partial_keeps_python_s_own_exit(tmp_path: Path) -> None:
    code = HELD_BY_A_PACKAGE + "\nimport functools\ndef wait(event):\n    event.wait()\n"
    code += "\nthreading.Thread(target=functools.partial(wait, threading.Event()), daemon=True).start()\n"
    completed, out = run_script(tmp_path, code, "1")
    assert completed.returncode == 0, completed.stderr
    assert Path(f"{out}.package").read_text() == "finalized"  # the step was skipped


@pytest.mark.timeout(120)
def test_lockstep_run_compiles_the_script_as_python_does_and_finds_a_symlinked_scripts_folder(
    tmp_path: Path,
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "helper.py").write_text("VALUE = 1\n")
    (real / "main.py").write_text(
        "import sys\nimport helper\ndef f(x: int) -> None: ...\n"
        "print(f.__annotations__['x'] is int, helper.VALUE, sys.argv[1:])\n"
    )
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "main.py").symlink_to(real / "main.py")
    env = {**os.environ, "LOCKSTEP_WARM_START": "0"}
    completed = subprocess.run(
        [LOCKSTEP_COMMAND, "run", str(tmp_path / "linked" / "main.py"), "--", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=env,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == "True 1 ['--', 'x']\n"  # no __future__ annotations; the real folder; "--" kept


@pytest.mark.timeout(60)
def test_a_script_that_does_not_compile_shows_the_error_alone_as_under_python(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("x = (\n")
    env = {**os.environ, "LOCKSTEP_WARM_START": "0"}
    ours = subprocess.run([LOCKSTEP_COMMAND, "run", str(script)], capture_output=True, text=True, timeout=30, env=env)
    pythons = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert ours.returncode == pythons.returncode == 1
    assert ours.stderr == pythons.stderr and "launch.py" not in ours.stderr, ours.stderr
