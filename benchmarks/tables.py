"""Write the benchmark tables in benchmarks/README.md and docs/performance.md from benchmarks/results/.

Each block between ``<!-- tables:NAME begin -->`` and ``<!-- tables:NAME end -->`` is replaced:

* in benchmarks/README.md, ``tables:goals`` (every goal of the newest result of each kind, with
  its statistic, figure and verdict) and ``tables:KIND`` for each kind (``jobs``, ``checkpoint``,
  ``ray``, ``step``, ``payload``): the tables that script printed, with the file, command, date
  and commit they come from;
* in docs/performance.md (the documentation site's Performance page), ``tables:performance``:
  the headline rows of every kind, each with its source.

Only the newest results file of each kind is used (by its UTC date); results of ``--quick`` runs
and of partial runs (``--only`` or ``--targets`` leaving out a section) are left out unless
``--include-quick`` is given. A kind without results says so. No figure in
these blocks is typed by hand.

    .venv/bin/python benchmarks/tables.py [--include-quick] [--check]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from record import Goal  # noqa: E402 - benchmarks/ is the script folder

KINDS = {
    "jobs": "bench_jobs.py",
    "timeline": "timeline.py",
    "checkpoint": "checkpoint_bench.py",
    "throughput": "checkpoint_throughput.py",
    "ray": "ray_bench.py",
    "step": "step_bench.py",
    "payload": "payload_bench.py",
    "dashboard": "dashboard_bench.py",
    "scale": "scale_bench.py",
    "scale-small": "scale_bench.py --ranks 64 256",
    "many": "many_ranks_bench.py",
    "ray-many": "ray_many_bench.py",
}


def load_newest(results_dir: Path, include_quick: bool) -> dict[str, tuple[Path, dict[str, Any]]]:
    """The newest results file of each kind: kind -> (path, its contents)."""
    newest: dict[str, tuple[Path, dict[str, Any]]] = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"tables.py: {path} is not a readable results file ({error}); remove or fix it") from error
        kind = record.get("kind")
        if kind not in KINDS or ((record.get("quick") or record.get("partial")) and not include_quick):
            continue
        if kind not in newest or record["date_utc"] > newest[kind][1]["date_utc"]:
            newest[kind] = (path, record)
    return newest


def source(path: Path, record: dict[str, Any]) -> str:
    """Where a block's figures come from: file, command, date, commit."""
    git = record["git"]
    notes = (" (uncommitted changes in the tree)" if git.get("dirty") else "") + (
        " — a quick run, not a measurement" if record.get("quick") else ""
    )
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return f"Source: `{shown}`, command `{record['command']}`, {record['date_utc']}, commit {git['short']}{notes}."


def kind_block(kind: str, newest: dict[str, tuple[Path, dict[str, Any]]]) -> str:
    """The block of one script: its source line and the tables it printed."""
    if kind not in newest:
        return f"_No results of `{KINDS[kind]}` in benchmarks/results/ yet: run it (the command above)._"
    path, record = newest[kind]
    return f"{source(path, record)}\n\n{record['markdown']}"


def goals_block(newest: dict[str, tuple[Path, dict[str, Any]]]) -> str:
    """Every goal of the newest results, one table."""
    lines = [
        "| goal | statistic (fixed before measuring) | figure | 95% CI | result | source |",
        "|---|---|---:|---:|---|---|",
    ]
    for kind in KINDS:
        if kind not in newest:
            continue
        path, record = newest[kind]
        for goal in record.get("goals", []):
            sign = "<=" if goal["at_most"] else ">="
            unit = f" {goal['unit']}" if goal["unit"] else ""
            ci = f"{goal['ci95'][0]:.3f} – {goal['ci95'][1]:.3f}" if goal.get("ci95") else "–"
            lines.append(
                f"| {goal['name']} {sign} {goal['limit']:.3f}{unit} | {goal['statistic']} | "
                f"{goal['value']:.3f}{unit} | {ci} | {Goal.from_dict(goal).verdict} | `{path.name}` |"
            )
    if len(lines) == 2:
        return "_No results in benchmarks/results/ yet: run `make bench`._"
    return "\n".join(lines)


def performance_block(newest: dict[str, tuple[Path, dict[str, Any]]]) -> str:
    """The table of docs/performance.md: the headline rows of every kind, then their sources."""
    lines = ["| | lockstep | compared with | ratio | source |", "|---|---:|---:|---:|---|"]
    sources = []
    for index, kind in enumerate(KINDS, start=1):
        if kind not in newest:
            sources.append(f"{index}. `{KINDS[kind]}`: no results yet (run `make bench`).")
            continue
        path, record = newest[kind]
        for row in record.get("headline", []):
            lines.append(f"| {row['what']} | {row['lockstep']} | {row['compared_with']} | {row['ratio']} | [{index}] |")
        sources.append(f"{index}. {source(path, record)}")
    if not newest:
        return "_No results in benchmarks/results/ yet: run `make bench`._"
    return "\n".join(lines + [""] + sources)


def replace_block(text: str, name: str, content: str, where: Path) -> str:
    """``text`` with the block ``name`` holding ``content``; SystemExit when its markers are missing."""
    pattern = re.compile(rf"(<!-- tables:{name} begin -->\n).*?(<!-- tables:{name} end -->)", re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(
            f"tables.py: {where} has no '<!-- tables:{name} begin -->' ... '<!-- tables:{name} end -->' "
            "markers; add them where the table belongs"
        )
    return pattern.sub(lambda match: match.group(1) + content.rstrip("\n") + "\n" + match.group(2), text, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--results-dir", type=Path, default=HERE / "results")
    parser.add_argument("--include-quick", action="store_true", help="also use results of --quick and partial runs")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file would change")
    args = parser.parse_args(argv)
    newest = load_newest(args.results_dir, args.include_quick)
    blocks = {
        HERE / "README.md": {"goals": goals_block(newest), **{kind: kind_block(kind, newest) for kind in KINDS}},
        REPO / "docs" / "performance.md": {"performance": performance_block(newest)},
    }
    changed = []
    for path, contents in blocks.items():
        text = path.read_text()
        updated = text
        for name, content in contents.items():
            updated = replace_block(updated, name, content, path)
        if updated != text:
            changed.append(path)
            if not args.check:
                path.write_text(updated)
    used = ", ".join(f"{kind}: {path.name}" for kind, (path, _) in newest.items()) or "none"
    print(
        f"tables.py: results used: {used}; {'would change' if args.check else 'changed'}: "
        f"{', '.join(str(path.relative_to(REPO)) for path in changed) or 'nothing'}"
    )
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
