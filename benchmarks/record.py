"""Results files and the statistics that judge goals, shared by the benchmark scripts.

Every script run with ``--results-dir DIR`` (``make bench`` passes ``benchmarks/results``) writes
one JSON file ``DIR/<kind>-<UTC date-time>-<short commit>.json`` holding the date, the machine,
the git commit (and whether the tree was dirty), the exact command, the raw samples, the summary,
the goals with their verdicts, and the markdown the script printed. ``benchmarks/tables.py``
writes the README tables from the newest file of each kind.

A goal is judged by the statistic written next to it in the code (``Goal.statistic``), fixed
before measuring; the scripts print PASS or MISS with the figure. A goal with a 95% interval is
met only when the whole interval is on the right side of the limit (an interval that straddles
it is a MISS), and a goal measured on fewer than :data:`MIN_ROUNDS` interleaved rounds is never
met. ``tables.py`` judges the goals of older results files by the same rule.
"""

from __future__ import annotations

import datetime
import json
import random
import re
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
#: The fewest interleaved rounds a goal may be judged on.
MIN_ROUNDS = 5


@dataclass(frozen=True)
class Goal:
    """One goal: what is compared, the statistic that judges it, the limit, the figure, the verdict.

    ``at_most`` is True for "figure <= limit" goals, False for "figure >= limit". ``rounds``:
    how many interleaved rounds the figure comes from (None: not a per-round measurement).
    """

    name: str
    statistic: str
    value: float
    limit: float
    at_most: bool = True
    unit: str = ""
    ci95: tuple[float, float] | None = None
    rounds: int | None = None

    @property
    def judged_edge(self) -> float:
        """What is compared with the limit: the interval's far end when there is one, else the figure."""
        if self.ci95 is None:
            return self.value
        return self.ci95[1] if self.at_most else self.ci95[0]

    @property
    def met(self) -> bool:
        """Whether the figure, and all of its interval, are on the right side of the limit, on enough rounds."""
        if self.rounds is not None and self.rounds < MIN_ROUNDS:
            return False
        edge = self.judged_edge
        return edge <= self.limit if self.at_most else edge >= self.limit

    @property
    def verdict(self) -> str:
        """PASS, or MISS with why when the figure alone would pass."""
        if self.met:
            return "PASS"
        if self.rounds is not None and self.rounds < MIN_ROUNDS:
            return f"MISS (only {self.rounds} rounds, fewer than {MIN_ROUNDS})"
        figure_passes = self.value <= self.limit if self.at_most else self.value >= self.limit
        return "MISS (the interval straddles the limit)" if figure_passes else "MISS"

    def as_dict(self) -> dict[str, Any]:
        """The goal for the results file, with its verdict."""
        return {**asdict(self), "verdict": self.verdict}

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> Goal:
        """A goal as a results file stored it (its verdict recomputed by today's rule; a file
        older than the ``rounds`` field gives its rounds in the statistic, "... N rounds")."""
        fields = {name: stored[name] for name in cls.__dataclass_fields__ if name in stored}
        if fields.get("ci95") is not None:
            fields["ci95"] = tuple(fields["ci95"])
        if fields.get("rounds") is None:
            counted = re.search(r"(\d+) (?:interleaved )?(?:rounds|runs)", str(fields.get("statistic", "")))
            fields["rounds"] = int(counted.group(1)) if counted else None
        return cls(**fields)


def fmt(value: float, unit: str) -> str:
    """A figure with its unit, to 3 significant decimals."""
    return f"{value:.3f}{(' ' + unit) if unit else ''}"


def goals_markdown(goals: Sequence[Goal]) -> str:
    """The goals as a markdown table: goal, statistic, figure (with its 95% interval), verdict."""
    lines = ["| goal | statistic (fixed before measuring) | figure | 95% CI | result |", "|---|---|---:|---:|---|"]
    for goal in goals:
        sign = "<=" if goal.at_most else ">="
        ci = f"{fmt(goal.ci95[0], goal.unit)} – {fmt(goal.ci95[1], goal.unit)}" if goal.ci95 else "–"
        lines.append(
            f"| {goal.name} {sign} {fmt(goal.limit, goal.unit)} | {goal.statistic} | "
            f"{fmt(goal.value, goal.unit)} | {ci} | {goal.verdict} |"
        )
    return "\n".join(lines)


# -- statistics ---------------------------------------------------------------------------------


def bootstrap_ci(
    values: Sequence[float],
    statistic: Callable[[Sequence[float]], float] = statistics.median,
    level: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``statistic`` over ``values`` (fixed seed: reproducible)."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    generator = random.Random(BOOTSTRAP_SEED)
    estimates = sorted(statistic(generator.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return estimates[int(tail * (resamples - 1))], estimates[int((1 - tail) * (resamples - 1))]


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Per-round ratios of two equally long series measured in the same rounds."""
    if len(numerators) != len(denominators):
        raise ValueError(f"paired_ratios: {len(numerators)} against {len(denominators)} rounds")
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def ratio_goal(name: str, numerators: Sequence[float], denominators: Sequence[float], limit: float) -> Goal:
    """A "ratio <= limit" goal judged by the median of the paired per-round ratios."""
    ratios = paired_ratios(numerators, denominators)
    return Goal(
        name,
        f"median of paired per-round ratios, {len(ratios)} rounds",
        statistics.median(ratios),
        limit,
        ci95=bootstrap_ci(ratios),
        rounds=len(ratios),
    )


def ratio_of_medians(numerators: Sequence[float], denominators: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """median(numerators) / median(denominators), with a percentile bootstrap 95% interval that
    resamples whole rounds (the two series were measured interleaved, round by round)."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(f"ratio_of_medians: {len(numerators)} against {len(denominators)} rounds")
    rounds = range(len(numerators))
    generator = random.Random(BOOTSTRAP_SEED)
    estimates = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        picked = generator.choices(rounds, k=len(numerators))
        estimates.append(
            statistics.median(numerators[i] for i in picked) / statistics.median(denominators[i] for i in picked)
        )
    estimates.sort()
    interval = (estimates[int(0.025 * (BOOTSTRAP_RESAMPLES - 1))], estimates[int(0.975 * (BOOTSTRAP_RESAMPLES - 1))])
    return statistics.median(numerators) / statistics.median(denominators), interval


# -- results files ------------------------------------------------------------------------------


def git_state() -> dict[str, Any]:
    """The commit checked out (full and short) and whether the tree has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit, "short": commit[:7], "dirty": dirty}


def write_result(
    results_dir: Path | None,
    kind: str,
    command: str,
    machine: dict[str, str],
    quick: bool,
    document: dict[str, Any],
    goals: Sequence[Goal],
    markdown: str,
    headline: Sequence[dict[str, str]] = (),
) -> Path | None:
    """Write one results file into ``results_dir`` (nothing when it is None); return its path.

    ``headline``: rows for the top-level README's performance table (``what``, ``lockstep``,
    ``compared_with``, ``ratio``), already formatted by the script.
    """
    if results_dir is None:
        return None
    now = datetime.datetime.now(datetime.timezone.utc)
    git = git_state()
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    path = results_dir / f"{kind}-{stamp}-{git['short']}{'-quick' if quick else ''}.json"
    record = {
        "kind": kind,
        "quick": quick,
        "date_utc": now.isoformat(timespec="seconds"),
        "git": git,
        "command": command,
        "machine": machine,
        "goals": [goal.as_dict() for goal in goals],
        "headline": list(headline),
        "markdown": markdown,
        **document,
    }
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


def add_results_args(parser: Any) -> None:
    """The ``--results-dir`` option every script takes."""
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="write a results file (date, machine, commit, command, raw samples) into DIR; "
        "make bench passes benchmarks/results",
    )
