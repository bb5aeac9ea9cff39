"""Show and save the results: terminal table (rich when installed), JSON, PNG (matplotlib)."""

import json
import math
import os
from typing import Any

from commhooks.bench.units import format_bytes, format_rate

__all__ = ["print_table", "write_json", "write_plot"]


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def table_rows(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = [
        "hook",
        "network",
        "ms/step",
        "± IQR/2",
        "x allreduce",
        "x noop",
        "bytes/step/rank",
        "compression",
        "held-out loss",
        "peak mem",
        "status",
    ]
    body = []
    for r in rows:
        if not r["ok"]:
            body.append([r["hook"], format_rate(r["bandwidth"])] + ["-"] * 8 + ["FAILED"])
            continue
        spread = (r["step_ms_p75"] - r["step_ms_p25"]) / 2
        body.append(
            [
                r["hook"],
                format_rate(r["bandwidth"]),
                _fmt(r["step_ms_median"], ".1f"),
                _fmt(spread, ".1f"),
                _fmt(r.get("time_vs_allreduce"), ".2f"),
                _fmt(r.get("time_vs_noop"), ".2f"),
                format_bytes(r["bytes_per_step"]) + ("" if r.get("wire") else "*"),
                _fmt(r.get("compression_ratio"), ".1f", "x"),
                _fmt(r["heldout_loss"], ".3f"),
                format_bytes(r["peak_memory_bytes"]),
                "ok",
            ]
        )
    return head, body


def print_table(rows: list[dict], title: str, console: Any = None) -> None:
    """Print the comparison table, then one line per failed hook with its error."""
    head, body = table_rows(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
        print(title)
        for line in [head, *body]:
            print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    else:
        table = Table(title=title)
        for i, h in enumerate(head):
            table.add_column(h, justify="left" if i < 2 else "right")
        for line in body:
            table.add_row(*line)
        console = console or Console()
        if not console.is_terminal:  # a log or pipe: do not squeeze the table into 80 columns
            console = Console(width=170)
        console.print(table)
    if any(r["ok"] and not r.get("wire") for r in rows):
        print(
            "* bytes from the payload counted in the ranks and the ring-allreduce model "
            "(loopback has no private interface to count); --bandwidth reads real counters."
        )
    for r in rows:
        if not r["ok"]:
            print(f"FAILED {r['hook']} @ {format_rate(r['bandwidth'])}: {r['error']}")


def write_json(path: str, document: dict) -> None:
    """Write ``document`` atomically (a crash never leaves half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(document, f, indent=1, default=str)
    os.replace(tmp, path)


def write_plot(path: str, rows: list[dict], sweep: dict | None) -> str | None:
    """Loss against steps and against wall-clock, one line per hook (and network); with a
    sweep, speedup over allreduce against bandwidth. Returns a note when it cannot plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib, or '.[bench]')."
    good = [r for r in rows if r["ok"]]
    panels = 3 if sweep else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    several = len({r["bandwidth"] for r in good}) > 1
    for r in good:
        label = r["hook"] + (f" @ {format_rate(r['bandwidth'])}" if several else "")
        steps = [x[0] for x in r["losses"]]
        axes[0].plot(steps, [x[1] for x in r["losses"]], label=label)
        axes[1].plot([x[2] for x in r["losses"]], [x[1] for x in r["losses"]], label=label)
    axes[0].set(xlabel="step", ylabel="training loss (mean over ranks)", title="loss vs steps")
    axes[1].set(xlabel="seconds", ylabel="training loss", title="loss vs wall-clock")
    axes[0].legend(fontsize=7)
    if sweep:
        for hook, info in sweep.items():
            pts = sorted(
                (float(bw), s)
                for bw, s in info["speedup_vs_allreduce"].items()
                if s is not None and bw != "None"
            )
            if pts:
                axes[2].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=hook)
        axes[2].set_xscale("log")
        axes[2].axhline(1.0, color="grey", lw=0.8)
        axes[2].set(
            xlabel="bandwidth (bit/s)",
            ylabel="speedup over allreduce",
            title="speedup vs bandwidth",
        )
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
