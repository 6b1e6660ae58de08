"""Charts for the benchmarks: grouped bar charts drawn from the numbers a bench prints, as
PNGs (matplotlib, headless). `make bench` writes them to docs/img/, where the docs show a
recorded run's."""

from __future__ import annotations

from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "docs" / "img"
COLORS = ("#4a7ab8", "#e39b3b", "#5aa469", "#b85a5a", "#8a6bb8", "#7f7f7f")


def grouped_bars(path: Path, title: str, groups: list[str], series: dict[str, list[float]],
                 ylabel: str, note: str = "", value_format: str = "{:.0f}") -> str:
    """Bars of each series side by side per group; returns a line saying what was written."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no chart written"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7.5, 1.3 * len(groups) * max(1, len(series)) / 2 + 1),
                                    4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name, color=COLORS[i % len(COLORS)])
        ax.bar_label(bars, [value_format.format(v) for v in values], fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"chart written to {path}"
