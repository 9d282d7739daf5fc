"""What the bench/plot_*.py charts share: grouped bars and a labelled reference line (matplotlib)."""


def grouped_bars(ax, xlabels, series, fontsize=8):
    """One group of bars per x label, one bar per series ((label, values) pairs, values in xlabels'
    order), the series side by side in 80% of each slot."""
    width = 0.8 / len(series)
    for i, (label, ys) in enumerate(series):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(xlabels))], ys, width, label=label)
    ax.set_xticks(range(len(xlabels)), xlabels, fontsize=fontsize)


def reference_line(ax, y, text=None):
    """A dashed gray line at y (a bar, parity), labelled at the left when text is given."""
    ax.axhline(y, color="gray", linestyle="--", linewidth=0.8)
    if text:
        ax.text(-0.55, y, text, va="bottom", ha="left", fontsize=8, color="gray")
