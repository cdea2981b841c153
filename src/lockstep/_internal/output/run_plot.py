"""``lockstep plot``: a run's metrics (or several runs' overlaid) against the report index,
drawn with matplotlib into a file."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from lockstep._internal.persist.results import history_row
from lockstep._internal.persist.run_status import shown_status
from lockstep._internal.persist.storage import RunStorage
from lockstep.callbacks import numeric_metrics

__all__ = ["StoredRun", "import_pyplot", "plot_run", "plot_runs", "plotted_metrics"]

#: A run folder and its record, read once.
StoredRun = tuple[RunStorage, dict[str, Any]]


def plotted_metrics(history: list[dict[str, Any]]) -> list[str]:
    """Metric names with a number in at least one report (in first-seen order)."""
    names: dict[str, None] = {}
    for row in history:
        names.update(
            dict.fromkeys(
                numeric_metrics({key: value for key, value in row.items() if key not in ("report_index", "timestamp")})
            )
        )
    return list(names)


def import_pyplot() -> Any:
    """matplotlib's pyplot, drawing into files (no display needed).

    Raises:
        ImportError: matplotlib is not installed; the message says how to install it.
    """
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "`lockstep plot` draws with matplotlib, which is not installed in this environment "
            f"({sys.executable}); install it with `pip install matplotlib`, then run the command again."
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run: RunStorage, metrics: Sequence[str] | None, output: str) -> list[str]:
    """Draw each metric of one run against the report index into ``output`` (one panel per
    metric); return the metrics drawn. See :func:`plot_runs`."""
    return plot_runs([(run, {})], metrics, output)


def plot_runs(runs: Sequence[StoredRun], metrics: Sequence[str] | None, output: str) -> list[str]:
    """Draw each metric against the report index into ``output``, one panel per metric and, with
    several runs, one line per run (labelled with its name and a status other than finished);
    return the metrics drawn. Without ``metrics``: those of the first run.

    Raises:
        ValueError: a run lacks a chosen metric, or there is nothing numeric to draw.
        ImportError: matplotlib is not installed.
    """
    plt = import_pyplot()
    from matplotlib.ticker import MaxNLocator

    histories = [[history_row(report) for report in run.read_reports()] for run, _ in runs]
    chosen = list(metrics or plotted_metrics(histories[0]))
    for (run, _), history in zip(runs, histories, strict=True):
        available = plotted_metrics(history)
        unknown = [name for name in chosen if name not in available]
        if unknown or not chosen:
            raise ValueError(
                f"no numeric metric {unknown or ''} in {run.display_path}; it has: {', '.join(available) or 'none'}."
            )
    figure, axes = plt.subplots(
        len(chosen), 1, figsize=(7, 2.6 * len(chosen) + 0.4 * (len(runs) > 1)), sharex=True, squeeze=False
    )
    for axis, name in zip(axes[:, 0], chosen, strict=True):
        for (run, record), history in zip(runs, histories, strict=True):
            points = [(row["report_index"], row[name]) for row in history if isinstance(row.get(name), (int, float))]
            axis.plot(
                [index for index, _ in points],
                [value for _, value in points],
                marker="o",
                markersize=3,
                label=_run_label(run, record),
            )
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("report")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(runs) > 1:
        axes[0, 0].legend(fontsize="small", ncol=2 if len(runs) > 4 else 1)
    figure.suptitle(runs[0][0].name if len(runs) == 1 else f"{len(runs)} runs")
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return chosen


def _run_label(run: RunStorage, record: dict[str, Any]) -> str:
    status = shown_status(record) if record else "finished"
    return run.name if status == "finished" else f"{run.name} ({status})"
