"""The bench's picture: which hook pays on which link, and what it costs in accuracy.

Left, each hook's predicted speedup over ``allreduce`` against the link rate (both axes
logarithmic), a line per hook from the loopback run and the cost model, with the rates of
the ladder marked and, where links were run, the measured speedups as points on the lines.
Middle, each hook's held-out loss after the run, beside ``allreduce``'s. Right, each hook's
training loss against time on the slowest link measured. One legend serves all three.
Needs matplotlib (``--plot`` is refused up front without it).
"""

import math
from typing import Any

from commhooks.bench import hookset
from commhooks.bench.predict import Model, network_of
from commhooks.bench.rows import Row
from commhooks.bench.shape import Shape
from commhooks.bench.summary import by_network
from commhooks.bench.units import format_rate

__all__ = ["draw", "write_plot"]

_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_COARSE_TICKS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
_FINE_TICKS = (0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 4, 5, 7, 10, 15, 20, 30, 50, 70, 100)


def _drawn(rows: list[Row]) -> list[Row]:
    """The loopback rows worth a line: every hook that ran, but the measuring floors."""
    return [
        r
        for r in by_network(rows).get(None, {}).values()
        if r.ok and r.hook not in hookset.FLOOR_HOOKS
    ]


def _rates(ladder: list[int]) -> list[float]:
    """Rates from a quarter of the ladder's lowest to twice its highest, evenly in log, and
    the ladder's own."""
    low, high = math.log10(min(ladder) / 4), math.log10(max(ladder) * 2)
    return sorted({10 ** (low + (high - low) * i / 80) for i in range(81)} | set(ladder))


def _measured(rows: list[Row], hook: str) -> list[tuple[float, float]]:
    """(rate, measured speedup over allreduce) of ``hook`` on each link run, from the means
    (the prediction is of the mean)."""
    points = []
    for bandwidth, table in by_network(rows).items():
        row, ref = table.get(hook), table.get("allreduce")
        if bandwidth is None or not (row and ref and row.ok and ref.ok):
            continue
        if row.step_ms_mean and ref.step_ms_mean:
            points.append((float(bandwidth), ref.step_ms_mean / row.step_ms_mean))
    return points


def _speedup_panel(
    ax: Any, rows: list[Row], answer: dict[str, Any], styles: dict[str, Any]
) -> None:
    measured, shape = _shapes(answer)
    model = Model.from_rows(
        by_network(rows)[None],
        measured,
        answer["latency_s"],
        network_of(answer),  # under a launcher: its time taken out of each step, as predicted
        backend=answer.get("backend", "gloo"),
        intra_bps=answer.get("intra_link_bps"),
    )
    rates = _rates(answer["links"])
    marks = [rates.index(b) for b in answer["links"]]
    for row in _drawn(rows):
        speedups = [model.speedup(row.hook, b, shape) or math.nan for b in rates]
        ax.plot(rates, speedups, **styles[row.hook], markevery=marks, label=row.hook)
        points = _measured(rows, row.hook)
        if points:
            ax.plot(*zip(*points), linestyle="none", **_hollow(styles[row.hook]))
    ax.axhline(1.0, color="black", linewidth=0.8)
    for rate in answer["links"]:
        ax.axvline(rate, color="0.8", linewidth=0.8, zorder=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(rates[0], rates[-1])
    ax.set_xticks(answer["links"], [format_rate(b) for b in answer["links"]])
    ax.minorticks_off()
    low, high = ax.get_ylim()
    ticks = [t for t in _COARSE_TICKS if low <= t <= high]
    if len(ticks) < 4:  # a narrow range: finer steps
        ticks = [t for t in _FINE_TICKS if low <= t <= high]
    ax.set_yticks(ticks, [f"{t:g}x" for t in ticks])
    ax.set_xlabel("link rate (each machine's link, both directions)")
    ax.set_ylabel("speedup over allreduce (above 1: pays)")
    ax.set_title(f"predicted step speedup, {shape.text()}", fontsize=11)
    ax.grid(True, which="major", axis="y", color="0.9")


def _shapes(answer: dict[str, Any]) -> tuple[Shape, Shape]:
    """The shape the rows were measured on and the first one predicted for (a saved run from
    before shapes: its ranks, each a machine)."""
    if "shape_measured" not in answer:
        return Shape.of_ranks(answer["ranks_measured"]), Shape.of_ranks(answer["world_size"])
    first = answer["shapes"][0]["shape"]
    measured = answer["shape_measured"]
    return Shape(measured["nodes"], measured["per_node"]), Shape(first["nodes"], first["per_node"])


def _hollow(style: dict[str, Any]) -> dict[str, Any]:
    """A measured point: the hook's marker, larger and hollow."""
    return {
        "marker": style["marker"],
        "markersize": 11,
        "markerfacecolor": "white",
        "markeredgecolor": style["color"],
        "markeredgewidth": 2,
    }


def _loss_panel(ax: Any, rows: list[Row], styles: dict[str, Any]) -> None:
    """Each hook's held-out loss as a point on its own line (a bar from zero would hide the
    differences that matter), with allreduce's as a dashed reference."""
    drawn = [r for r in _drawn(rows) if r.heldout_loss is not None]
    for y, row in enumerate(drawn):
        loss = float(row.heldout_loss or 0.0)
        style = styles[row.hook]
        ax.plot(
            [loss],
            [y],
            linestyle="none",
            marker=style["marker"],
            markersize=9,
            color=style["color"],
            markeredgecolor="black",
        )
        ax.annotate(
            f"{loss:.3f}",
            (loss, y),
            xytext=(8, 0),
            textcoords="offset points",
            va="center",
            fontsize=9,
        )
    reference = next((r.heldout_loss for r in drawn if r.hook == "allreduce"), None)
    if reference is not None:
        ax.axvline(reference, color="black", linestyle="--", linewidth=1)
    losses = [float(r.heldout_loss or 0.0) for r in drawn]
    margin = (max(losses) - min(losses)) or 0.05
    ax.set_xlim(min(losses) - 0.3 * margin, max(losses) + 0.6 * margin)
    ax.set_ylim(len(drawn) - 0.5, -0.5)
    ax.set_yticks(range(len(drawn)), [r.hook for r in drawn])
    ax.grid(True, axis="x", color="0.9")
    ax.set_xlabel("held-out loss after the run (lower is better)")
    ax.set_title("accuracy (dashed: allreduce)", fontsize=11)


def _curve_panel(ax: Any, rows: list[Row], styles: dict[str, Any]) -> None:
    """Each hook's training loss (mean of 5 steps) against wall-clock time, on the slowest
    link measured (loopback without one), with allreduce's final loss dashed: time to a loss,
    which is what a slow link costs."""
    tables = by_network(rows)
    links = sorted(b for b in tables if b is not None)
    bandwidth = links[0] if links else None
    drawn = [
        r for r in tables.get(bandwidth, {}).values() if r.ok and r.losses and r.hook in styles
    ]
    for row in drawn:
        losses = [loss for _, loss, _ in row.losses]
        smooth = [sum(losses[max(0, i - 4) : i + 1]) / min(i + 1, 5) for i in range(len(losses))]
        style = styles[row.hook]
        ax.plot(
            [t for _, _, t in row.losses],
            smooth,
            color=style["color"],
            linestyle=style["linestyle"],
            linewidth=1.5,
        )
    reference = next((r for r in drawn if r.hook == "allreduce"), None)
    if reference is not None:
        window = [loss for _, loss, _ in reference.losses[-5:]]
        ax.axhline(sum(window) / len(window), color="black", linestyle="--", linewidth=1)
    ax.grid(True, color="0.9")
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("training loss (mean of 5 steps)")
    where = format_rate(bandwidth) if bandwidth is not None else "loopback"
    ax.set_title(f"loss against time, {where} (dashed: allreduce's final)", fontsize=11)


def _styles(rows: list[Row]) -> dict[str, Any]:
    """One colour, line style and marker per hook, shared by both panels; noop in grey."""
    from matplotlib import colormaps

    palette = [colormaps["tab10"](i) for i in range(10)]
    styles = {}
    for i, row in enumerate(r for r in _drawn(rows) if r.hook != "noop"):
        styles[row.hook] = {
            "color": palette[i % len(palette)],
            "linestyle": _STYLES[i % len(_STYLES)],
            "marker": _MARKERS[i % len(_MARKERS)],
            "linewidth": 2,
        }
    styles["noop"] = {"color": "0.55", "linestyle": ":", "marker": "x", "linewidth": 2}
    return styles


def write_plot(path: str, rows: list[Row], answer: dict[str, Any], title: str) -> None:
    """Write the PNG to ``path``; nothing is drawn without a successful loopback run."""
    fig = draw(rows, answer, title)  # chooses the Agg backend before pyplot is imported
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw(rows: list[Row], answer: dict[str, Any], title: str) -> Any:
    """The figure :func:`write_plot` saves: three panels and, below them, one legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, curves) = plt.subplots(
        1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [2.2, 1, 1.6]}
    )
    if "world_size" in answer and by_network(rows).get(None):
        styles = _styles(rows)
        _speedup_panel(left, rows, answer, styles)
        _loss_panel(right, rows, styles)
        _curve_panel(curves, rows, styles)
        measured = any(r.bandwidth is not None for r in rows)
        subtitle = "lines: predicted from the loopback run (filled marks at the ladder's rates)" + (
            "; hollow marks: measured on links" if measured else ""
        )
        fig.suptitle(f"{title}\n{subtitle}", fontsize=12)
        handles, labels = left.get_legend_handles_labels()
        columns = min(6, len(labels))
        fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=10)
        rows_of_legend = -(-len(labels) // columns)  # below the panels' axis labels, not on them
        fig.tight_layout(rect=(0, 0.02 + 0.055 * rows_of_legend, 1, 1))
    return fig
