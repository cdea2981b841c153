"""Draw a run's metric curves (from ``Result.metrics_dataframe``) into a PNG file."""

from __future__ import annotations

import pandas


def plot_metrics(frame: pandas.DataFrame, columns: dict[str, str], path: str, title: str) -> str:
    """One panel per metric against the epoch (counted from 1); ``columns`` maps each metric
    name to its panel title. Returns the written path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(1, len(columns), figsize=(4.5 * len(columns), 3.6), squeeze=False)
    for axis, (column, label) in zip(axes[0], columns.items(), strict=True):
        axis.plot(frame["epoch"] + 1, frame[column], marker="o")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_xlabel("epoch")
        axis.set_title(label)
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
