"""A few dozen kills (the bounded CI subset of benchmarks/kill_trials.py, whose 1,000-trial run is
`make kill-trials`): SIGKILL the driver, a rank or the whole job at random moments of a run that
checkpoints at every step, on local disk and on the S3 test server, then run it again; after
every trial every counted checkpoint verifies, the history has no gap or repeat, and the rerun
resumed from the newest committed checkpoint."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import kill_trials  # noqa: E402 - benchmarks/ is not a package

TRIALS = 20


@pytest.mark.timeout(420)
def test_a_few_dozen_kills_leave_nothing_half_written(tmp_path: Path) -> None:
    results = tmp_path / "kills.jsonl"
    args = kill_trials.parse_args(
        ["--trials", str(TRIALS // 2), "--results", str(results), "--seed", "24", "--work-dir", str(tmp_path)]
    )
    kill_trials.run_trials(args)
    args.trials = TRIALS  # the harness is resumable: the second call adds the missing trials
    trials = kill_trials.run_trials(args)

    assert [trial["trial"] for trial in trials] == list(range(TRIALS))
    assert len(results.read_text().splitlines()) == TRIALS
    failed = {trial["trial"]: trial["problems"] for trial in trials if trial["problems"]}
    assert not failed, json.dumps(failed, indent=1)
    # not vacuous: kills of every kind landed on both stores, and some while checkpoints were written
    landed = collections.Counter((trial["store"], trial["killed"]) for trial in trials if trial["killed"])
    for store in ("local", "s3"):
        assert landed[(store, "driver")] + landed[(store, "job")] >= 2, landed
    assert sum(count for (_, killed), count in landed.items() if killed == "rank") >= 1, landed
    progressed = [trial for trial in trials if trial["killed"] and trial["reports"] > 0]
    assert len(progressed) >= 4, "too few kills landed after the first report"
