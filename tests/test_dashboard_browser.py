"""`lockstep dashboard` in a real browser: Debian's headless Chromium, driven by Selenium through
Debian's chromedriver (tests/browser.py). Over one storage path holding a finished run and a
failed one (real fits, two ranks each), a 10,000-report run of two ranks (written by the run
recorder) and a live run whose reports the test releases one at a time.

Each page's screenshot is checked as not blank; with ``LOCKSTEP_SCREENSHOT_DIR`` set, the
screenshots are also written there (docs/dashboard.png is the run page of the long run).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from browser import chromium, missing_browser
from conftest import untagged
from dashboard_runs import open_gate, start_dashboard, start_gated_run, stop, stop_gated_run, wait_for, write_long_run

import lockstep
from lockstep import Checkpoint, RunConfig, ScalingConfig, TrainingFailedError
from lockstep.torch import TorchTrainer

#: The page of a run with 10,000 reports must be drawn within this, from navigation to its first render.
LOAD_BOUND_MS = 1000


def three_reports_with_checkpoints() -> None:
    for step in range(3):
        print(f"epoch {step} done", flush=True)
        folder = tempfile.mkdtemp()
        Path(folder, "weights.bin").write_bytes(b"\0" * 2048)
        lockstep.report(
            {"step": step, "loss": 1.0 / (step + 1), "accuracy": 0.5 + 0.1 * step},
            checkpoint=Checkpoint.from_directory(folder),
        )


def rank_1_fails() -> None:
    lockstep.report({"step": 0, "loss": 2.0})
    if lockstep.get_context().get_world_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    lockstep.report({"step": 1, "loss": 1.0})


@dataclass
class Site:
    """The runs, the dashboard serving them, and the browser."""

    url: str
    browser: Any
    gates: Path
    storage: str
    reports_released: int = 0
    shots: list[Path] = field(default_factory=list)

    def release_report(self) -> None:
        """Let the live run make one more report."""
        open_gate(self.gates, str(self.reports_released))
        self.reports_released += 1

    def open(self, path: str, timeout_s: float = 30) -> None:
        """Go to a page and wait until its script has drawn it."""
        self.browser.get(self.url + path.lstrip("/"))
        wait_for(
            lambda: self.browser.execute_script("return document.body.dataset.loaded") == "1",
            timeout_s,
            f"the page {path} to load",
        )

    def text(self, selector: str) -> str:
        return str(
            self.browser.execute_script(
                "const node = document.querySelector(arguments[0]); return node ? node.textContent : ''", selector
            )
        )

    def points(self, metric: str) -> int:
        found = self.browser.execute_script(
            "const c = document.querySelector(`canvas[data-metric='${arguments[0]}']`); "
            "return c ? c.dataset.points : null",
            metric,
        )
        return int(found) if found is not None else -1


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    reason = missing_browser()
    if reason is not None:
        pytest.skip(reason)
    storage = str(tmp_path_factory.mktemp("dashboard_browser") / "results")
    TorchTrainer(
        three_reports_with_checkpoints,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="finished", storage_path=storage, verbose=0),
    ).fit()
    with pytest.raises(TrainingFailedError):
        TorchTrainer(
            rank_1_fails,
            scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(name="failed", storage_path=storage, verbose=0),
        ).fit()
    write_long_run(storage, "long-run")
    gates = tmp_path_factory.mktemp("gates")
    with contextlib.ExitStack() as cleanup:
        with untagged():  # these serve the whole module; the finalizers below end them
            live = start_gated_run(storage, "live", gates)
            cleanup.callback(stop_gated_run, live, gates)
            dashboard, url = start_dashboard(storage)
            cleanup.callback(stop, dashboard)
            browser = cleanup.enter_context(chromium())
        site = Site(url, browser, gates, storage)
        site.release_report()
        reports = Path(storage, "live", "reports.jsonl")
        wait_for(lambda: reports.is_file() or live.poll() is not None, 90, "the live run's first report")
        assert live.poll() is None, f"the live run ended: {stop_gated_run(live, gates)}"
        yield site


def screenshot(site: Site, name: str) -> Path:
    """Save a screenshot of the page, check that it is not blank, and keep it where asked."""
    path = Path(tempfile.gettempdir()) / f"lockstep_dashboard_{name}.png"
    assert site.browser.save_screenshot(str(path))
    assert_not_blank(path)
    keep = os.environ.get("LOCKSTEP_SCREENSHOT_DIR")
    if keep:
        shutil.copy(path, Path(keep) / f"dashboard_{name}.png")
    return path


def assert_not_blank(path: Path) -> None:
    """A page drawn: many colours, and no single colour over 95 % of the pixels."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = image.convert("RGB")
        colours = pixels.getcolors(maxcolors=1 << 20) or []
        area = pixels.width * pixels.height
    assert len(colours) > 50, f"{path}: only {len(colours)} colours"
    assert max(count for count, _ in colours) < 0.95 * area, f"{path}: one colour covers the page"


def test_the_runs_list_shows_a_finished_and_a_running_run_and_filters_them(site: Site) -> None:
    site.open("/")
    statuses = site.browser.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('tr[data-run]')]"
        ".map(r => [r.dataset.run, r.dataset.status]))"
    )
    assert statuses == {"finished": "finished", "live": "running", "failed": "failed", "long-run": "finished"}
    assert "failed on rank 1" in site.text("tr[data-run='failed']")
    screenshot(site, "runs")

    search = site.browser.find_element("id", "filter")
    search.send_keys("fin")
    wait_for(
        lambda: (
            site.browser.execute_script(
                "return [...document.querySelectorAll('tr[data-run]')].map(r => r.dataset.run).join()"
            )
            == "finished"
        ),
        10,
        "the filter to leave one run",
    )
    search.clear()
    site.browser.execute_script("document.querySelector('th[data-key=reports]').click()")
    order = site.browser.execute_script("return [...document.querySelectorAll('tr[data-run]')].map(r => r.dataset.run)")
    assert order[0] == "long-run", f"sorted by reports, most first: {order}"


def test_a_live_runs_curve_gains_a_point_after_a_new_report(site: Site) -> None:
    site.open("/runs/live")
    assert site.text("h1 .badge") == "running"
    before = wait_for(lambda: max(site.points("loss"), 0), 30, "the loss curve's points")
    site.release_report()
    wait_for(lambda: site.points("loss") == before + 1, 30, "the curve to gain the new report's point")
    wait_for(lambda: "makes report" in site.text("pre.log"), 30, "rank 0's log tail")
    screenshot(site, "live")


def test_a_failed_run_shows_the_failed_ranks_traceback(site: Site) -> None:
    site.open("/runs/failed")
    assert site.text("h1 .badge") == "failed"
    traceback = site.text(".failure[data-rank='1'] pre.traceback")
    assert (
        traceback.startswith("Traceback (most recent call last)")
        and "RuntimeError: rank 1 fails on purpose" in traceback
    )
    assert "failed (RuntimeError)" in site.text("#ranks tr[data-rank='1']")
    screenshot(site, "failed")


def test_a_run_page_with_10000_reports_of_2_ranks_loads_within_a_second(site: Site) -> None:
    started = time.monotonic()
    site.open("/runs/long-run")
    loaded_ms = site.browser.execute_script("return window.lockstepLoadedMs")
    print(f"long run's page: drawn {loaded_ms:.0f} ms after navigation ({time.monotonic() - started:.2f} s here)")
    assert loaded_ms < LOAD_BOUND_MS, f"the page took {loaded_ms:.0f} ms"
    assert site.points("loss") == 10_000
    assert "slow (data)" in site.text("#ranks tr[data-rank='1']")
    assert "trainer-1" in site.text("#ranks tr[data-rank='1']")
    screenshot(site, "run")


def test_runs_side_by_side_overlay_their_curves(site: Site) -> None:
    site.open("/compare?runs=finished&runs=long-run")
    assert site.points("loss") == 10_000 + 3
    assert "finished" in site.text("#legend tr[data-run='finished']")
    screenshot(site, "compare")
