"""The warm process started early: at ``import lockstep`` in a script (lockstep._internal.early_warm),
before a script's first line under ``lockstep run`` (lockstep._internal.launch), importing what the
script imports (lockstep._internal.warm.preload.guessed_modules) until the driver asks for more."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from lockstep._internal.warm.preload import FOR_PREPARED_MODELS, scan_script
from lockstep._internal.warm.zygote import Zygote

LOCKSTEP_COMMAND = str(Path(sys.executable).with_name("lockstep"))

WARM_FACTS = """
import json, os, sys
from lockstep._internal.warm import warm_start
pid = warm_start.warm_process_pid()
command = open(f"/proc/{pid}/cmdline").read().split("\\0") if pid else []
print("RESULT", json.dumps({"warm": pid, "guessed": json.loads(command[5]) if len(command) > 5 else None,
                            "torch": "torch" in sys.modules}))
"""


def result_of(completed: subprocess.CompletedProcess[str]) -> dict:
    assert completed.returncode == 0, f"exit {completed.returncode}\n{completed.stdout}\n{completed.stderr}"
    return json.loads(completed.stdout.split("RESULT ", 1)[1].splitlines()[0])


def run(command: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, env={**os.environ, **env})


# -- what a script's imports guess ---------------------------------------------------------------


def test_the_guess_is_the_installed_packages_the_script_and_its_own_modules_import(tmp_path: Path) -> None:
    (tmp_path / "helpers.py").write_text("import numpy as np\nfrom . import nothing\n")
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import os, json
        import torch
        from torchvision import datasets
        import lockstep
        from lockstep.torch import prepare_model
        import ray.train
        from _private import thing
        import helpers

        def train():
            import pandas
    """)
    )
    # the script's top-level imports, then those inside its functions, then its own modules'
    scan = scan_script(str(script))
    assert scan.modules == ["torch", "torchvision", "pandas", *FOR_PREPARED_MODELS, "numpy"]
    assert scan.builds_trainer is False
    (tmp_path / "helpers.py").write_text("import numpy\nfrom lockstep.torch import TorchTrainer\n")
    assert scan_script(str(script)).builds_trainer is True, "a trainer named in the script's own module counts"


def test_a_package_beside_the_script_is_the_users_even_when_an_installed_one_has_its_name(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\nimport numpy\nfrom numpy import linalg\n")
    assert scan_script(str(script)).modules == ["torch", "numpy"]  # installed: worth importing ahead
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("linalg = None\n")
    assert scan_script(str(script)).modules == ["torch"]  # the local copy: the workers import it from disk


def test_a_script_that_cannot_be_read_or_parsed_guesses_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\ndef (:\n")
    assert scan_script(str(broken)).modules == []
    assert scan_script(str(tmp_path / "missing.py")).modules == []


# -- the warm process's side of the guess --------------------------------------------------------


GUESSING = """
import json, socket, sys, threading
from lockstep._internal.warm.zygote import import_guessed
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
ours.send(b'{"op": "prepare"}')
waiting = import_guessed(["tabnanny"], theirs), "tabnanny" in sys.modules
theirs.recv(100)
idle = import_guessed(["no_such_module_anywhere", "tabnanny"], theirs), "tabnanny" in sys.modules
threading.Thread(target=threading.Event().wait, daemon=True).start()
threaded = import_guessed(["colorsys"], theirs)
print("RESULT", json.dumps({"waiting": waiting, "idle": idle, "threaded": threaded}))
"""


@pytest.mark.timeout(60)
def test_guessed_imports_stop_when_the_driver_asks_and_say_when_a_thread_makes_forking_unsafe() -> None:
    facts = result_of(run([sys.executable, "-c", GUESSING], LOCKSTEP_WARM_START="0"))
    assert facts["waiting"] == [None, False], "imported a guess while a request was waiting"
    assert facts["idle"] == [None, True]
    assert facts["threaded"].startswith("after importing 'colorsys' (imported by the script), 2 threads are running")


def test_a_warm_process_made_unsafe_by_a_guess_refuses_the_first_request() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        zygote = Zygote(theirs, unsafe="after importing 'threaded' (imported by the script), 2 threads are running")
        ours.send(json.dumps({"op": "prepare", "sys_path": sys.path, "modules": []}).encode())
        assert zygote._answer(theirs) is False
        reply = json.loads(ours.recv(1 << 16))
        assert reply["ok"] is False and "threaded" in reply["error"] and "can't fork safely" in reply["error"]
    finally:
        ours.close()
        theirs.close()


# -- when it starts ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_import_lockstep_in_a_script_starts_it_with_the_script_s_imports(tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(
        "import lockstep\nif False:\n    import torchvision\n    from lockstep.torch import TorchTrainer\n" + WARM_FACTS
    )
    facts = result_of(run([sys.executable, str(script)]))
    assert facts["warm"] is not None and facts["torch"] is False, "import lockstep loaded torch in the driver"
    assert facts["guessed"] == ["torchvision"]
    assert result_of(run([sys.executable, str(script)], LOCKSTEP_WARM_START="0"))["warm"] is None
    tool = tmp_path / "tool.py"
    tool.write_text("import lockstep\n" + WARM_FACTS)
    assert result_of(run([sys.executable, str(tool)]))["warm"] is None, "a script naming no trainer got one"


@pytest.mark.timeout(120)
def test_import_lockstep_outside_a_script_starts_nothing(tmp_path: Path) -> None:
    assert result_of(run([sys.executable, "-c", "import lockstep\n" + WARM_FACTS]))["warm"] is None
    (tmp_path / "as_module.py").write_text("import lockstep  # builds a TorchTrainer later\n" + WARM_FACTS)
    # python -m: lockstep was imported by the module's code, so the module is the script...
    assert result_of(run([sys.executable, "-m", "as_module"], PYTHONPATH=str(tmp_path)))["warm"] is not None
    # ... but lockstep's own modules run with -m (workers, validation processes) are not
    probe = "import sys; sys.argv[0] = sys.argv[1]; import lockstep\n" + WARM_FACTS
    own = str(REPO_ROOT / "src" / "lockstep" / "torch" / "trainer.py")  # names TorchTrainer, yet lockstep's
    assert result_of(run([sys.executable, "-c", probe, own]))["warm"] is None


# -- lockstep run --------------------------------------------------------------------------------

FIRST_LINE = """
import os, sys
children = open(f"/proc/self/task/{os.getpid()}/children").read().split()
print("FIRST", {"children": len(children), "argv": sys.argv, "path0": sys.path[0], "name": __name__})
"""


@pytest.mark.timeout(120)
def test_lockstep_run_runs_the_script_as_python_would_with_the_warm_process_already_started(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(FIRST_LINE + "import torch\nimport lockstep\n" + WARM_FACTS + "sys.exit(3)\n")
    completed = run([LOCKSTEP_COMMAND, "run", str(script), "--lr", "0.1", "x"])
    assert completed.returncode == 3, completed.stderr
    first = completed.stdout.split("FIRST ", 1)[1].splitlines()[0]
    assert first == repr(
        {"children": 1, "argv": [str(script), "--lr", "0.1", "x"], "path0": str(tmp_path), "name": "__main__"}
    )
    facts = json.loads(completed.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert facts["warm"] is not None and facts["guessed"] == ["torch"]


@pytest.mark.timeout(60)
def test_lockstep_run_shows_the_script_s_exception_from_the_script_on(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("def main():\n    raise ValueError('bad learning rate')\nmain()\n")
    completed = run([LOCKSTEP_COMMAND, "run", str(script)], LOCKSTEP_WARM_START="0")
    assert completed.returncode == 1
    assert completed.stderr.splitlines()[1] == f'  File "{script}", line 3, in <module>', completed.stderr
    assert completed.stderr.rstrip().endswith("ValueError: bad learning rate")
    missing = run([LOCKSTEP_COMMAND, "run", str(tmp_path / "nope.py")])
    assert missing.returncode == 2 and "no script at" in missing.stderr


@pytest.mark.timeout(120)
def test_lockstep_run_trains_with_workers_forked_by_the_early_warm_process(tmp_path: Path, storage_path: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(f"""
        import os
        import torch
        import lockstep
        from lockstep.torch import TorchTrainer, prepare_model
        from lockstep._internal.warm import warm_start

        def train():
            model = prepare_model(torch.nn.Linear(2, 1))
            model(torch.ones(1, 2)).sum().backward()
            lockstep.report({{"parent": os.getppid()}})

        result = TorchTrainer(train, scaling_config=lockstep.ScalingConfig(num_workers=2),
                              run_config=lockstep.RunConfig(storage_path={storage_path!r}, name="early")).fit()
        assert result.metrics["parent"] == warm_start.warm_process_pid(), (
            result.metrics,
            warm_start.warm_process_pid(),
        )
        print("TRAINED")
    """)
    )
    completed = run([LOCKSTEP_COMMAND, "run", str(script)])
    assert completed.returncode == 0 and "TRAINED" in completed.stdout, completed.stderr
