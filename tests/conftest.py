"""Shared fixtures: a results folder per test, and a check that no worker outlives its test.

With ``CI=true`` a skip is an error unless the test is marked ``gpu``: a missing package, data
folder or ``ip netns`` must fail CI, not thin it out. GPU skips are counted apart, as
"skipped (no GPU)", in the closing line.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    import subprocess

    from hosts import HostNetwork

TEST_TAG = f"LOCKSTEP_TEST_TAG={uuid.uuid4().hex}"
os.environ["LOCKSTEP_TEST_TAG"] = TEST_TAG.split("=", 1)[1]

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("LOCKSTEP_DATA", REPO_ROOT.parent / "shared" / "data"))


def tagged_processes() -> list[int]:
    """Processes other than this one that inherited this test session's tag (workers,
    drivers started by tests, their children). This process's warm process (started when a
    test module imported lockstep.torch, kept for the whole session) is not counted."""
    from lockstep._internal.warm.warm_start import warm_process_pid

    found = []
    needle = TEST_TAG.encode()
    ours = {os.getpid(), warm_process_pid()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in ours:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


#: Variables ray.init() sets in its caller's environment (a new local Ray turns token
#: authentication on), which would otherwise reach the subprocesses of later tests.
RAY_VARIABLES = ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")
# Every Ray the tests start is private to this machine and session: no token authentication,
# so clusters started in-process, drivers started as subprocesses and `ray start` on the test
# hosts all agree (Ray 2.60 turns tokens on for a new local Ray and writes ~/.ray/auth_token).
os.environ["RAY_AUTH_MODE"] = "disabled"


IN_CI = os.environ.get("CI") == "true"
GPU_SKIPPED = "skipped (no GPU)"


def _skip_reason(longrepr: Any) -> str:
    """The reason of a skip report (pytest keeps it as (path, line, "Skipped: reason"))."""
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def _ci_error(where: str, longrepr: Any) -> str:
    return (
        f"CI=true: {where} would be skipped ({_skip_reason(longrepr)}). In CI only tests marked 'gpu' may "
        "skip: install what the reason names (.ci/run installs the system packages, `make install` the "
        "Python ones) or fix the cause."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under CI, a skipped test that is not a GPU test fails instead (see the module docstring)."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("gpu") is None:
        report.outcome = "failed"
        report.longrepr = _ci_error(item.nodeid, report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """Under CI, a module skipped whole (``pytest.importorskip`` of a missing package) fails instead."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped:
        report.outcome = "failed"
        report.longrepr = _ci_error(f"every test of {collector.nodeid}", report.longrepr)


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> tuple[str, str, str] | None:
    """GPU tests that skip are counted as "skipped (no GPU)" in the closing line."""
    if report.skipped and "gpu" in report.keywords and not hasattr(report, "wasxfail"):
        return GPU_SKIPPED, "s", "SKIPPED (no GPU)"
    return None


@pytest.fixture(autouse=True)
def ray_variables_restored() -> Iterator[None]:
    """Put back the Ray variables a test (or its Ray) changed in this process's environment."""
    saved = {name: os.environ.get(name) for name in RAY_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def sigint_raises() -> None:
    """For ``Popen(preexec_fn=...)`` in a test that sends SIGINT: the child starts with SIGINT's
    default disposition, so its Python turns SIGINT into KeyboardInterrupt, also when the test
    session runs as a shell's background job (which starts with SIGINT ignored, inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def no_process_left_behind() -> None:
    """Fail a test that leaves any process it started running. Killed processes take a moment
    to disappear, so this waits for them, up to a bound."""
    yield
    left = tagged_processes_after(time.monotonic() + 10)
    assert not left, f"processes left behind: {left}"


def wait_for_first_report(reports: Path, driver: subprocess.Popen[Any], timeout_s: float = 90) -> None:
    """Wait until the run whose ``reports.jsonl`` is ``reports`` has written a whole line,
    while ``driver`` (the process running it) lives.

    Raises:
        AssertionError: the driver ended, or no report came within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not (reports.exists() and reports.read_text().endswith("\n")):
        assert driver.poll() is None and time.monotonic() < deadline, "the run never reported"
        time.sleep(0.05)


def tagged_processes_after(deadline: float) -> list[int]:
    """The tagged processes still running at ``deadline`` (``time.monotonic()``), or none as soon
    as they are gone: killed processes take a moment to disappear."""
    while (left := tagged_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def running_after(pids: Iterable[int], timeout_s: float, zombies_count: bool = True) -> set[int]:
    """The processes of ``pids`` still there after up to ``timeout_s`` (none as soon as all are
    gone). A zombie (ended, not yet reaped by its parent) counts unless ``zombies_count`` is False."""
    deadline = time.monotonic() + timeout_s
    while (left := {pid for pid in pids if _there(pid, zombies_count)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _there(pid: int, zombies_count: bool) -> bool:
    try:
        state = stat_fields(pid)[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return zombies_count or state != "Z"


def stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name (which may hold spaces): the state first,
    then the parent's pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int:
    """The pid of ``pid``'s parent process."""
    return int(stat_fields(pid)[1])


_STACK_HEADER = re.compile(r"^ranks? ([\d, -]+) (?:was|were) still running, here:\n", re.MULTILINE)


def stacks_by_rank(message: str) -> dict[int, str]:
    """The stacks a failure's message shows, by rank: ranks with the same stack share one
    paragraph (``ranks 0, 2 were still running, here:``), which each of them gets here."""
    headers = list(_STACK_HEADER.finditer(message))
    stacks: dict[int, str] = {}
    for header, following in zip(headers, [*headers[1:], None], strict=True):
        stack = message[header.end() : following.start() if following else len(message)].rstrip("\n")
        for span in header.group(1).split(", "):
            first, _, last = span.partition("-")
            for rank in range(int(first), int(last or first) + 1):
                stacks[rank] = stack
    return stacks


@contextlib.contextmanager
def untagged() -> Iterator[None]:
    """Start processes (a Ray cluster serving a whole module, say) without this session's test
    tag, so the leaked-process check doesn't count them against the test that started them;
    whoever starts them must stop them."""
    tag = os.environ.pop("LOCKSTEP_TEST_TAG", None)
    try:
        yield
    finally:
        if tag is not None:
            os.environ["LOCKSTEP_TEST_TAG"] = tag


@pytest.fixture
def storage_path(tmp_path: Path) -> str:
    """A fresh storage_path for one test."""
    return str(tmp_path / "results")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared Fashion-MNIST folder (torchvision layout)."""
    if not (DATA_DIR / "FashionMNIST" / "raw").is_dir():
        pytest.skip(f"Fashion-MNIST not found in {DATA_DIR}; set LOCKSTEP_DATA")
    return DATA_DIR


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server (a real process on 127.0.0.1) for one test module, with the bucket "runs"
    created and the AWS_* variables pointing at it."""
    from s3_server import s3_environment, s3_server

    with s3_server() as env, s3_environment(env):
        yield env


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[HostNetwork]:
    """Two test hosts for one test module: network namespaces on one private subnet, each with
    its own address (see tests/hosts.py); every process on them is killed, and the namespaces
    and links deleted, at the end. Skipped where namespaces can't be made (not root, no ``ip``)."""
    from hosts import HostNetwork, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"test hosts (network namespaces) unavailable: {reason}")
    with HostNetwork(2) as network:
        yield network
