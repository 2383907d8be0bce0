"""The plot shapes the notebooks share: bars for a comparison, lines for curves."""

from __future__ import annotations

import matplotlib.pyplot as plt


def bars(labels, values, *, ylabel: str, title: str, ax=None, fmt: str = "{:.2f}", color=None):
    """A bar chart with each value written on its bar; returns the figure."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(5, 3.2))
    else:
        fig = ax.figure
    rects = ax.bar([str(label) for label in labels], values, color=color or "#4c72b0")
    for r, v in zip(rects, values):
        ax.annotate(fmt.format(v), (r.get_x() + r.get_width() / 2, r.get_height()), ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def curves(series: dict, *, xlabel: str, ylabel: str, title: str, ax=None, logy: bool = False):
    """One line per entry of ``series`` (name → list of y values); returns the figure."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
    else:
        fig = ax.figure
    for name, ys in series.items():
        ax.plot(range(len(ys)), ys, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logy:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
