"""Prometheus metrics of the runs this process drives, served over HTTP in Prometheus' text
format with ``prometheus_client`` (``pip install 'lockstep[metrics]'``).

On when ``RunConfig(metrics_port=N)`` or ``LOCKSTEP_METRICS_PORT=N`` (``0``: a free port). The
server listens on every interface (``LOCKSTEP_METRICS_HOST`` picks one, e.g. ``127.0.0.1``);
its URL is logged and written in the run record as ``metrics_url``.

One server per port and process: fits that run at once in one driver (an Optuna study with
``n_jobs=2``) and ask for the same port share its server, each run's series told apart by their
``run`` label, so one scrape target covers a whole sweep and no fit fails to bind a port another
holds. A run's series stay for ``LOCKSTEP_METRICS_LINGER_S`` seconds (default 5) after it ends,
so that the next scrape sees how it ended; the process waits for that before it exits, and the
server closes once it serves no run.

The exporter is a built-in listener (:class:`MetricsExporter`) plus an observer of the worker
group's events (:mod:`lockstep._internal.run.group_tap`); the numbers it keeps are in
:mod:`lockstep._internal.output.metrics_state`, and the metric families are listed in
:data:`FAMILIES` (the docs' metrics table follows it).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from lockstep._internal.config_checks import check_metrics_port
from lockstep._internal.output.metrics_families import families_of
from lockstep._internal.output.metrics_state import RunMetrics
from lockstep._internal.output.progress import log_clear_of_line
from lockstep.callbacks import AttemptStart, Callback, RunInfo
from lockstep.checkpoint import Checkpoint
from lockstep.config import RunConfig

logger = logging.getLogger(__name__)

METRICS_PORT_ENV = "LOCKSTEP_METRICS_PORT"
METRICS_HOST_ENV = "LOCKSTEP_METRICS_HOST"
METRICS_LINGER_ENV = "LOCKSTEP_METRICS_LINGER_S"
DEFAULT_LINGER_S = 5.0


def metrics_port(run_config: RunConfig) -> int | None:
    """The port the run's metrics are served on: ``RunConfig.metrics_port``, else
    ``LOCKSTEP_METRICS_PORT``; ``None``: no metrics.

    Raises:
        ValueError: ``LOCKSTEP_METRICS_PORT`` is not a port number.
    """
    if run_config.metrics_port is not None:
        return int(run_config.metrics_port)
    raw = os.environ.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        port = None
    check_metrics_port(port if port is not None else raw, METRICS_PORT_ENV)
    return port


def linger_s() -> float:
    """How long a run's series outlive it (``LOCKSTEP_METRICS_LINGER_S``)."""
    try:
        return max(0.0, float(os.environ.get(METRICS_LINGER_ENV, DEFAULT_LINGER_S)))
    except ValueError:
        return DEFAULT_LINGER_S


# -- the servers ----------------------------------------------------------------------------------


class MetricsHub:
    """One HTTP server and the runs it serves (its collector yields each family once, with a
    series per run)."""

    def __init__(self, port: int, host: str) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as error:
            raise ImportError(
                "RunConfig(metrics_port=...) / LOCKSTEP_METRICS_PORT serve Prometheus metrics with prometheus_client, "
                "which is not installed; install it with `pip install 'lockstep[metrics]'`, or unset the port."
            ) from error
        self.runs: dict[str, RunMetrics] = {}
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)  # a collector: prometheus_client calls its collect()
        self.server, self._thread = start_http_server(port, addr=host, registry=registry)
        shown_host = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
        self.url = f"http://{shown_host}:{self.server.server_port}/metrics"

    def collect(self) -> Iterator[Any]:
        """The metric families of every run served (called by prometheus_client per scrape)."""
        with _hubs_lock:
            runs = list(self.runs.values())
        yield from families_of(runs)

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()


_hubs: dict[int, MetricsHub] = {}  # by the port asked for (0: the one free port picked for all who ask 0)
_hubs_lock = threading.RLock()


def join(port: int, run: RunMetrics) -> str:
    """Serve ``run`` on ``port`` (starting that port's server if needed); return its URL.

    Raises:
        OSError: the port can't be bound.
        ImportError: prometheus_client is missing.
    """
    with _hubs_lock:
        hub = _hubs.get(port)
        if hub is None:
            hub = _hubs[port] = MetricsHub(port, os.environ.get(METRICS_HOST_ENV, "0.0.0.0"))
        hub.runs[run.name] = run  # a run of the same name that still lingers gives way
        return hub.url


def leave(port: int, run: RunMetrics, after_s: float) -> None:
    """Stop serving ``run`` after ``after_s`` seconds (the process waits for it before exiting);
    the server closes when it serves no run."""
    if after_s <= 0:
        _forget(port, run)
        return
    timer = threading.Timer(after_s, _forget, args=(port, run))
    timer.daemon = False
    timer.name = f"lockstep-metrics-linger-{run.name}"
    timer.start()


def _forget(port: int, run: RunMetrics) -> None:
    with _hubs_lock:
        hub = _hubs.get(port)
        if hub is None or hub.runs.get(run.name) is not run:
            return
        del hub.runs[run.name]
        if not hub.runs:
            del _hubs[port]
            hub.close()


# -- checkpoint sizes, measured off the controller's thread ----------------------------------------

_sizes: queue.Queue[tuple[RunMetrics, Checkpoint]] = queue.Queue()
_size_thread: threading.Thread | None = None


def measure_later(run: RunMetrics, checkpoint: Checkpoint) -> None:
    """Add the size of ``checkpoint`` to ``run``'s figures from a background thread (listing a
    checkpoint on an object store takes round trips the next report must not wait for)."""
    global _size_thread
    _sizes.put((run, checkpoint))
    with _hubs_lock:
        if _size_thread is None:
            _size_thread = threading.Thread(target=_measure_sizes, name="lockstep-checkpoint-sizes", daemon=True)
            _size_thread.start()


def _measure_sizes() -> None:
    while True:
        run, checkpoint = _sizes.get()
        try:
            run.checkpoint_measured(int(checkpoint.filesystem.du(checkpoint.path, total=True)))
        except Exception as error:  # noqa: BLE001 - a size we can't read is left out, not fatal
            logger.debug("could not measure the checkpoint %s: %s", checkpoint.uri, error)


# -- the listener ----------------------------------------------------------------------------------


class MetricsExporter(Callback):
    """The built-in listener that serves a run's metrics (see the module's docstring).

    Args:
        name: The run's name (the ``run`` label).
        port: The port asked for.
        preemption_notices: How many preemption notices the run has had so far.

    Raises:
        OSError: the port can't be bound.
        ImportError: prometheus_client is missing.
    """

    def __init__(self, name: str, port: int, preemption_notices: Callable[[], int] = lambda: 0) -> None:
        self.port = port
        self.state = RunMetrics(name, preemption_notices)
        self.url = join(port, self.state)
        self._left = False
        log_clear_of_line(logger, logging.INFO, "Prometheus metrics of run %s: %s", name, self.url)

    def observe(self, events: Any) -> None:
        """The tap's observer: the worker group's events."""
        self.state.observe(events)

    def on_attempt_start(self, run: RunInfo, attempt: AttemptStart) -> None:
        self.state.attempt_started(attempt.world_size, attempt.reason == "restart")

    def on_workers_changed(self, run: RunInfo, alive: int) -> None:
        self.state.workers_changed(alive)

    def after_report(self, run: RunInfo, index: int, metrics: dict[str, Any]) -> None:
        self.state.report_recorded(index, metrics)

    def on_checkpoint(self, run: RunInfo, index: int, checkpoint: Checkpoint) -> None:
        self.state.checkpoint_committed()
        measure_later(self.state, checkpoint)

    def on_failure(self, run: RunInfo, error: Exception, restarting: bool) -> None:
        self.state.failed()

    def on_run_end(self, run: RunInfo, status: str, error: Exception | None) -> None:
        self.state.ended(status)
        self.release(linger_s())

    def release(self, after_s: float = 0.0) -> None:
        """Stop serving this run (once), after ``after_s`` seconds."""
        if not self._left:
            self._left = True
            leave(self.port, self.state, after_s)


def start_exporter(run_config: RunConfig, name: str, preemption_notices: Callable[[], int]) -> MetricsExporter | None:
    """The run's exporter, serving already, or None when metrics are off or its port can't be
    bound (then a warning says why; the run goes on without metrics).

    Raises:
        ValueError: ``LOCKSTEP_METRICS_PORT`` is not a port number.
        ImportError: a port is set and prometheus_client is missing.
    """
    port = metrics_port(run_config)
    if port is None:
        return None
    try:
        return MetricsExporter(name, port, preemption_notices)
    except OSError as error:
        logger.warning(
            "Run %s goes on without Prometheus metrics: port %d can't be bound (%s). Pick a free port, or 0 "
            "for any free one.",
            name,
            port,
            error,
        )
        return None
