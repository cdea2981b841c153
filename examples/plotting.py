"""Draw a run's metric curves (from ``Result.metrics_dataframe``) into a PNG file."""

from __future__ import annotations

import pandas


def plot_metrics(frame: pandas.DataFrame, columns: list[str], path: str, title: str, x: str = "epoch") -> str:
    """One panel per metric in ``columns`` against ``x``; returns the written path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(columns), figsize=(4.5 * len(columns), 3.6), squeeze=False)
    for axis, column in zip(axes[0], columns):
        axis.plot(frame[x], frame[column], marker="o")
        axis.set_xlabel(x)
        axis.set_title(column)
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
