"""The warm process (lockstep._internal.warm.warm_start): workers forked from a process that imported
torch before fit(), reused by later fits, off with LOCKSTEP_WARM_START=0, and the bad cases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import REPO_ROOT, parent_of, tagged_processes, tagged_processes_after, wait_for_first_report

import lockstep
from lockstep import RunConfig, ScalingConfig
from lockstep._internal.installed import installed_file
from lockstep._internal.warm import warm_start
from lockstep.torch import TorchTrainer

SCRIPTS = Path(__file__).parent / "scripts"


def record_rank(folder: str, name: str) -> None:
    """In a worker: write what the test checks about this rank's process to a file."""
    import os
    import sys

    from lockstep._internal.warm import warm_start as in_worker

    rank = lockstep.get_context().get_world_rank()
    facts = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "sid": os.getsid(0),
        "cwd": os.getcwd(),
        "env": os.environ.get("WARM_TEST_VALUE"),
        "sys_path": sys.path,
        "warm_pid": in_worker.warm_process_pid(),
    }
    with open(os.path.join(folder, f"{name}_rank{rank}.json"), "w") as handle:
        json.dump(facts, handle)
    lockstep.report({"done": 1})


def fit_recording(storage: str, folder: Path, name: str) -> list[dict]:
    TorchTrainer(
        lambda: record_rank(str(folder), name),
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage, name=name),
    ).fit()
    return [json.loads((folder / f"{name}_rank{rank}.json").read_text()) for rank in range(2)]


def os_threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def run_driver(tmp_path: Path, body: str, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` as a driver script in a fresh process; it prints RESULT <json>."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(body))
    completed = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "results")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, f"exit {completed.returncode}\n{completed.stdout}\n{completed.stderr}"
    return completed


def result_of(completed: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(completed.stdout.split("RESULT ", 1)[1].splitlines()[0])


FIT_PPIDS = """
    import json, logging, os, signal, sys, time
    logging.basicConfig(level=logging.WARNING)
    import lockstep
    from lockstep import RunConfig, ScalingConfig
    from lockstep.torch import TorchTrainer
    from lockstep._internal.warm import warm_start

    def train():
        lockstep.report({"ppid": os.getppid()})

    def fit(name):
        result = TorchTrainer(train, scaling_config=ScalingConfig(num_workers=2),
                              run_config=RunConfig(storage_path=sys.argv[1], name=name)).fit()
        return result.metrics["ppid"]
"""


@pytest.fixture
def fresh_warm_process() -> None:
    """This test process's own warm process, started afresh: earlier tests in the session may
    have used, refused or killed the one its import of lockstep.torch started."""
    warm_start.shutdown()
    warm_start.start_in_background()


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("fresh_warm_process")
def test_fits_fork_their_workers_from_one_warm_process(storage_path: str, tmp_path: Path) -> None:
    warm = warm_start.warm_process_pid()
    assert warm is not None, "importing lockstep.torch started no warm process"
    first = fit_recording(storage_path, tmp_path, "first")
    second = fit_recording(storage_path, tmp_path, "second")
    for facts in first + second:
        assert facts["ppid"] == warm, "a worker was not forked by the warm process"
        assert facts["sid"] == facts["pid"], "a worker is not in a session of its own"
        assert facts["warm_pid"] is None, "a worker started a warm process of its own"
    assert {facts["pid"] for facts in first}.isdisjoint(facts["pid"] for facts in second), "each fit has new workers"
    assert warm_start.warm_process_pid() == warm and os.path.exists(f"/proc/{warm}"), "the warm process was not kept"
    assert os_threads(warm) == 1, "the warm process runs threads (unsafe to fork)"


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("fresh_warm_process")
def test_workers_see_the_environment_path_and_modules_of_fit_time(
    storage_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert warm_start.warm_process_pid() is not None
    late = tmp_path / "late_modules"
    late.mkdir()
    (late / "warm_late_module.py").write_text("VALUE = 'imported after the warm process started'\n")
    monkeypatch.syspath_prepend(str(late))
    monkeypatch.setenv("WARM_TEST_VALUE", "set after import")
    monkeypatch.chdir(tmp_path)
    import warm_late_module  # type: ignore[import-not-found]  # noqa: PLC0415

    def train() -> None:
        lockstep.report({"value": warm_late_module.VALUE})
        record_rank(str(tmp_path), "late")

    result = TorchTrainer(
        train, scaling_config=ScalingConfig(num_workers=2), run_config=RunConfig(storage_path=storage_path, name="late")
    ).fit()
    assert result.metrics_dataframe["value"][0] == "imported after the warm process started"
    for rank in range(2):
        facts = json.loads((tmp_path / f"late_rank{rank}.json").read_text())
        assert facts["ppid"] == warm_start.warm_process_pid()
        assert facts["env"] == "set after import"
        assert facts["cwd"] == str(tmp_path)
        assert str(late) in facts["sys_path"]


@pytest.mark.timeout(120)
def test_the_setting_turns_it_off(tmp_path: Path) -> None:
    completed = run_driver(
        tmp_path,
        FIT_PPIDS
        + """
    print("RESULT", json.dumps({"warm": warm_start.warm_process_pid(), "ppid": fit("off"), "driver": os.getpid()}))
    """,
        110,
        LOCKSTEP_WARM_START="0",
    )
    result = result_of(completed)
    assert result["warm"] is None
    assert result["ppid"] == result["driver"], "with the setting off, the driver starts its workers"


@pytest.mark.timeout(150)
def test_a_killed_warm_process_means_plain_starts_said_once(tmp_path: Path) -> None:
    completed = run_driver(
        tmp_path,
        FIT_PPIDS
        + """
    warm = warm_start.warm_process_pid()
    first = fit("first")
    os.kill(warm, signal.SIGKILL)
    later = [fit("second"), fit("third")]
    print("RESULT", json.dumps({"warm": warm, "first": first, "later": later, "driver": os.getpid()}))
    """,
        140,
    )
    result = result_of(completed)
    assert result["first"] == result["warm"]
    assert result["later"] == [result["driver"]] * 2, "after the warm process died, fits start workers themselves"
    assert completed.stderr.count("warm worker process can't be used") == 1, completed.stderr


@pytest.mark.timeout(180)
def test_a_ray_fit_stops_the_unused_warm_process_and_a_later_local_fit_brings_it_back(tmp_path: Path) -> None:
    completed = run_driver(
        tmp_path,
        FIT_PPIDS
        + """
    import ray
    warm = warm_start.warm_process_pid()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    TorchTrainer(train, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(storage_path=sys.argv[1], name="on_ray")).fit()
    after_ray = warm_start.warm_process_pid()
    ray.shutdown()
    local_ppid = fit("local")
    back = warm_start.warm_process_pid()
    print("RESULT", json.dumps({"warm": warm, "after_ray": after_ray, "local": local_ppid, "back": back,
                                "warm_alive": os.path.exists(f"/proc/{warm}"), "driver": os.getpid()}))
    """,
        170,
        RAY_AUTH_MODE="disabled",
    )
    result = result_of(completed)
    assert result["warm"] is not None and result["after_ray"] is None, "a Ray fit stops the unused warm process"
    assert not result["warm_alive"]
    assert result["local"] == result["driver"], "the next local fit starts its workers itself"
    assert result["back"] not in (None, result["warm"]), "and a new warm process waits for the fits after it"


@pytest.mark.timeout(120)
def test_a_killed_driver_takes_the_warm_process_and_workers_with_it(tmp_path: Path) -> None:
    script = SCRIPTS / "report_then_train_forever.py"
    reports = tmp_path / "results" / "forever" / "reports.jsonl"
    driver = subprocess.Popen([sys.executable, str(script), str(tmp_path / "results")])
    try:
        wait_for_first_report(reports, driver)
        parents = {pid: parent_of(pid) for pid in tagged_processes()}
        workers = [pid for pid, parent in parents.items() if parent not in (driver.pid, os.getpid())]
        assert len(parents) >= 4 and len(workers) == 2, f"expected driver, warm process and 2 workers: {parents}"
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert tagged_processes_after(time.monotonic() + 10) == [], "processes outlived their killed driver"


CHECK_NOTHING_WARM = """
import json, sys
{setup}
from lockstep._internal.warm import warm_start
print("RESULT", json.dumps({{"warm": warm_start.warm_process_pid(), "torch": "lockstep.torch" in sys.modules}}))
"""


@pytest.mark.timeout(120)
def test_nothing_warm_under_torchrun_in_the_cli_or_a_multiprocessing_child(tmp_path: Path, storage_path: str) -> None:
    def check(setup: str, **env: str) -> dict:
        script = tmp_path / "check.py"  # a file: multiprocessing's spawn imports it again
        script.write_text(CHECK_NOTHING_WARM.format(setup=setup))
        completed = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
            cwd=REPO_ROOT,
        )
        assert completed.returncode == 0, completed.stderr
        return result_of(completed)

    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    assert check("import lockstep.torch", **torchrun) == {"warm": None, "torch": True}
    console = str(Path(sys.executable).with_name("lockstep"))  # what the console command's argv[0] is
    cli = (
        f"sys.argv = [{console!r}, 'runs', {storage_path!r}]; "
        "import lockstep, lockstep.cli; lockstep.cli.main(sys.argv[1:])"
    )
    assert check(cli) == {"warm": None, "torch": False}, "the CLI imported lockstep.torch"
    spawned = (
        "import multiprocessing as mp\n"
        "def child(queue):\n"
        "    import lockstep.torch\n"
        "    from lockstep._internal.warm import warm_start\n"
        "    queue.put(warm_start.warm_process_pid())\n"
        "if __name__ == '__main__':\n"
        "    context = mp.get_context('spawn'); queue = context.Queue()\n"
        "    process = context.Process(target=child, args=(queue,)); process.start()\n"
        "    assert queue.get(timeout=50) is None, 'a multiprocessing child started a warm process'\n"
        "    process.join()"
    )
    check(spawned)  # the child's answer is checked in the script (the parent, a script, has its own)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("fresh_warm_process")
def test_installed_packages_the_job_names_are_imported_once_in_the_warm_process(storage_path: str) -> None:
    import torchvision

    warm = warm_start.warm_process_pid()
    assert warm is not None

    def train() -> None:
        lockstep.report({"transform": type(torchvision.transforms.ToTensor()).__name__})

    result = TorchTrainer(
        train,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage_path, name="preload"),
    ).fit()
    assert result.metrics["transform"] == "ToTensor"
    with open(f"/proc/{warm}/maps") as maps:
        assert "torchvision" in maps.read(), "torchvision was not imported in the warm process before forking"
    assert os_threads(warm) == 1


def test_installed_files_are_those_under_this_python_s_installation_not_beside_it() -> None:
    import torch

    assert installed_file(torch.__file__) and installed_file(os.path.dirname(os.__file__))
    assert not installed_file(__file__), "the user's own files (these tests) are not installed"
    assert installed_file(os.path.join(sys.prefix, "lib", "x.py"))
    assert not installed_file(sys.prefix.rstrip(os.sep) + "2" + os.sep + "x.py"), (
        "a folder beside the venv is not in it"
    )
