"""A real S3-compatible server for the tests: moto's standalone server, in its own process,
listening on 127.0.0.1 only."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_listening(port: int, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"moto_server exited with code {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"moto_server did not listen on port {port} within {timeout_s} s")


@contextmanager
def s3_server(check_credentials: bool = False) -> Iterator[dict[str, str]]:
    """Start moto_server and yield the AWS environment variables that point at it. With
    ``check_credentials`` it refuses unknown access keys, as AWS does."""
    executable = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or "moto_server"
    port = _free_port()
    # Without the test tag: the server outlives single tests on purpose (one per module).
    env = {key: value for key, value in os.environ.items() if key != "LOCKSTEP_TEST_TAG"}
    if check_credentials:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    process = subprocess.Popen(
        [executable, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    try:
        _wait_until_listening(port, process, timeout_s=30)
        yield {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "lockstep-test",
            "AWS_SECRET_ACCESS_KEY": "lockstep-test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    finally:
        process.kill()
        process.wait()


def apply_env(env: dict[str, str]) -> dict[str, str | None]:
    """Set ``env`` in os.environ and return the previous values, for restore_env."""
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    return previous


def restore_env(previous: dict[str, str | None]) -> None:
    """Undo apply_env."""
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextmanager
def s3_environment(env: dict[str, str], bucket: str = "runs") -> Iterator[None]:
    """While the ``with`` block runs: ``env`` in os.environ (the AWS_* variables of a server),
    s3fs without instances cached for an earlier server, and ``bucket`` created."""
    import s3fs

    previous = apply_env(env)
    try:
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        yield
    finally:
        restore_env(previous)
        s3fs.S3FileSystem.clear_instance_cache()
