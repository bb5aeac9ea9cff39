"""Show and save the results: the tables and the answer in 80 columns, and the JSON.

The default table is compact, one per network, so that it fits an 80-column terminal: what a
reader compares at a glance. ``--wide`` prints every figure in one table. The answer follows:
each hook's predicted step time on the ladder of links, where it pays, and which hook to use
on which link.
"""

import json
import math
import os
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from commhooks.bench.rows import Row
from commhooks.bench.summary import LOSS_WINDOW, NOISE_SUGGESTION, SPREAD_LIMIT, by_network
from commhooks.bench.units import format_bytes, format_rate

__all__ = [
    "WIDTH",
    "answer_lines",
    "print_report",
    "results_lines",
    "sweep_lines",
    "table_lines",
    "write_json",
]

WIDTH = 80
Column = tuple[str, Callable[[Row], str]]


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:{spec}}{suffix}"


def _ms(value: float | None) -> str:
    """Milliseconds without an exponent: whole from 100 up, 3 significant digits below."""
    if value is None or not math.isfinite(value):
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _spread(r: Row) -> str:
    spread = r.noise.get("relative_spread")
    return _fmt(100 * spread, ".0f", "%") if spread is not None else "-"


def _reached(r: Row) -> str:
    if r.steps_to_allreduce_loss is None:
        return "-"
    return f"{r.steps_to_allreduce_loss} @{r.time_to_allreduce_loss_s:.1f}s"


def _note(r: Row) -> str:
    if not r.ok:
        return "FAILED"
    return "noisy" if r.noise.get("noisy") else "ok"


def _error(r: Row) -> str:
    return _fmt(100 * r.prediction["error"], "+.0f", "%") if r.prediction else "-"


def _predicted(r: Row) -> str:
    return _ms(r.prediction["step_ms"]) if r.prediction else "-"


def _sent(r: Row) -> str:
    return format_bytes(r.bytes_per_step) + ("" if r.wire else "*")


_HOOK: Column = ("hook", lambda r: r.hook)
_STEP: Column = ("ms/step", lambda r: _ms(r.step_ms_median))
_SPREAD: Column = ("±", _spread)
_SENT: Column = ("sent/step", _sent)
_NOTE: Column = ("note", _note)
_HOST: Column = ("host", lambda r: _ms(r.host_step_ms_median))
_DEVICE_MEMORY: Column = ("dev mem", lambda r: format_bytes(r.device_peak_memory_bytes))
LOOPBACK_COLUMNS: list[Column] = [
    _HOOK,
    _STEP,
    _SPREAD,
    _SENT,
    ("held-out", lambda r: _fmt(r.heldout_loss, ".3f")),
    ("reached", _reached),
    _NOTE,
]
LINK_COLUMNS: list[Column] = [
    _HOOK,
    _STEP,
    _SPREAD,
    ("predicted", _predicted),
    ("error", _error),
    ("x allreduce", lambda r: _fmt(r.time_vs_allreduce, ".2f")),
    _SENT,
    _NOTE,
]
WIDE_COLUMNS: list[Column] = [
    _HOOK,
    ("network", lambda r: format_rate(r.bandwidth)),
    _STEP,
    ("±IQR/2", lambda r: _fmt(_half_iqr(r), ".1f")),
    ("mean", lambda r: _ms(r.step_ms_mean)),
    ("x allreduce", lambda r: _fmt(r.time_vs_allreduce, ".2f")),
    ("x noop", lambda r: _fmt(r.time_vs_noop, ".2f")),
    ("bytes/step/rank", _sent),
    ("compression", lambda r: _fmt(r.compression_ratio, ".1f", "x")),
    ("held-out loss", lambda r: _fmt(r.heldout_loss, ".3f")),
    ("vs allreduce", lambda r: _fmt(r.heldout_loss_vs_allreduce, "+.3f")),
    ("reached", _reached),
    ("peak mem", lambda r: format_bytes(r.peak_memory_bytes)),
    _HOST,
    _DEVICE_MEMORY,
    ("predicted", _predicted),
    ("error", _error),
    _NOTE,
]


def _half_iqr(r: Row) -> float | None:
    if r.step_ms_p75 is None or r.step_ms_p25 is None:
        return None
    return (r.step_ms_p75 - r.step_ms_p25) / 2


def _cells(r: Row, columns: list[Column]) -> list[str]:
    if r.ok:
        return [cell(r) for _, cell in columns]
    # A failed run has a name, a network and an error, nothing else.
    return [
        r.hook if name == "hook" else _note(r) if name == "note" else "-" for name, _ in columns
    ]


def _layout(lines: Sequence[Sequence[str]], gap: int = 2) -> list[str]:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for line in lines:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        out.append((" " * gap).join(cells).rstrip())
    return out


def _fitted(lines: Sequence[Sequence[str]]) -> list[str]:
    """Laid out with two spaces between columns, or one where two would exceed WIDTH."""
    text = _layout(lines)
    return text if max(len(line) for line in text) <= WIDTH else _layout(lines, gap=1)


def table_lines(rows: list[Row], columns: list[Column]) -> list[str]:
    """The rows as text columns, within WIDTH where the columns allow it."""
    return _fitted([[name for name, _ in columns]] + [_cells(r, columns) for r in rows])


def _footnotes(rows: list[Row], network: str = "loopback") -> list[str]:
    out = []
    if any(r.ok and not r.wire for r in rows):
        out.append(_payload_note(rows))
    if any(r.steps_to_allreduce_loss is not None for r in rows):
        out.append(
            f"reached: the step (and seconds) at which the training loss, averaged over "
            f"{LOSS_WINDOW} steps, first reached allreduce's final one; - never."
        )
    noisy = [r for r in rows if r.ok and r.noise.get("noisy")]
    if noisy:
        out.append(
            f"noisy: {len(noisy)} of {len(rows)} rows spread over {SPREAD_LIMIT:.0%} around "
            f"their median (±) or step faster than noop (their reasons: --wide, or the JSON's "
            f"'noise'); {NOISE_SUGGESTION}."
        )
    if _on_device(rows):
        out.append(
            "ms/step: the device's time per step (CUDA events); host: the ms the host took to "
            "issue it; dev mem: the device's peak allocated memory."
        )
    for r in rows:
        if not r.ok:
            where = network if r.bandwidth is None else format_rate(r.bandwidth)
            out.append(f"FAILED {r.hook} @ {where}: {r.error}")
    return [wrapped for line in out for wrapped in textwrap.wrap(line, WIDTH)]


def _payload_note(rows: list[Row]) -> str:
    """How the bytes of rows without a link to count were found; with machines of several
    ranks, they are a machine link's."""
    if all((r.shape or "x1").endswith("x1") for r in rows):
        return (
            "* bytes from the payload handed to each collective and the ring-allreduce model; "
            "links (--bandwidth) read real counters."
        )
    return (
        "* bytes each machine's link sends, from the payload handed to each collective and the "
        "collectives' algorithms; links (--bandwidth) read real counters."
    )


def _reasons(rows: list[Row]) -> list[str]:
    """Why each noisy row is noisy."""
    return [
        f"noisy {r.hook} @ {format_rate(r.bandwidth)}: {'; '.join(r.noise['reasons'])}"
        for r in rows
        if r.ok and r.noise.get("noisy")
    ]


def _on_device(rows: list[Row]) -> bool:
    return any(r.ok and (r.device or "cpu") != "cpu" for r in rows)


def results_lines(rows: list[Row], title: str, wide: bool, network: str = "loopback") -> list[str]:
    """The results tables (one per network, or one wide table) with their footnotes;
    ``network``: what the rows without a link rate ran on. On GPUs the compact table also
    shows the host's time per step and the device's peak memory, in place of the spread."""
    out = textwrap.wrap(title, WIDTH)
    if wide:
        return out + table_lines(rows, WIDE_COLUMNS) + _footnotes(rows, network) + _reasons(rows)
    for bandwidth, table in by_network(rows).items():
        columns = LOOPBACK_COLUMNS if bandwidth is None else LINK_COLUMNS
        if _on_device(rows):  # the spread gives way; a noisy row still says so in its note
            kept = [c for c in columns[:-1] if c is not _SPREAD]
            columns = [*kept, _HOST, _DEVICE_MEMORY, columns[-1]]
        where = network if bandwidth is None else f"a {format_rate(bandwidth)} link"
        out += ["", f"measured on {where}:"] + table_lines(list(table.values()), columns)
    return out + [""] + _footnotes(rows, network)


def _shaped(r: Row, key: str | None) -> dict[str, Any]:
    """The row's predictions for shape ``key`` (``None``, or a row without per-shape figures:
    the first shape's)."""
    if key is not None and key in r.by_shape:
        return r.by_shape[key]
    return {"predicted": r.predicted, "break_even_bps": r.break_even_bps}


def _pays_below(r: Row, key: str | None = None) -> str:
    shaped = _shaped(r, key)
    if r.hook == "allreduce" or not shaped["predicted"]:
        return "-"
    bps = shaped["break_even_bps"]
    if bps is None:
        return "always"
    return format_rate(bps) if bps > 0 else "never"


def _ladder_cell(r: Row, rate: str, key: str | None = None) -> str:
    p = _shaped(r, key)["predicted"].get(rate, {})
    return f"{_ms(p.get('step_ms')):>4} {_fmt(p.get('speedup_vs_allreduce'), '.2f', 'x'):>5}"


def _per_machine(r: Row, key: str | None) -> str:
    return format_bytes(_shaped(r, key).get("machine_bytes_per_step"))


def _ladder_table(rows: list[Row], rates: list[str], key: str | None = None) -> list[str]:
    """The ladder of shape ``key``, with the bytes a machine's link sends; ``None``: of a saved
    run from before shapes, as it printed then."""
    sent = [] if key is None else ["sent/machine"]
    head = ["hook", *sent, *(format_rate(int(b)) for b in rates), "pays below"]
    body = [
        [r.hook, *([] if key is None else [_per_machine(r, key)])]
        + [*(_ladder_cell(r, b, key) for b in rates), _pays_below(r, key)]
        for r in rows
    ]
    return _fitted([head, *body])


def _ladder_tables(rows: list[Row], rates: list[str], key: str | None = None) -> list[str]:
    """The ladder as one table, or as several in turn where one would exceed WIDTH."""
    for per_table in range(len(rates), 0, -1):
        tables = [
            _ladder_table(rows, rates[i : i + per_table], key)
            for i in range(0, len(rates), per_table)
        ]
        lines = [line for table in tables for line in table]
        if per_table == 1 or max(len(line) for line in lines) <= WIDTH:
            return lines
    return []


def _shape_lines(
    predicted: list[Row], shape: dict[str, Any] | None, answer: dict[str, Any]
) -> list[str]:
    """The ladder of one shape: per hook, what a machine's link sends per step, its step time
    and speedup on each link, and below which rate it pays; ``None``: the ranks of a saved run
    from before shapes."""
    rates = list(predicted[0].predicted) if predicted else []
    where = answer.get("measured_on", "loopback")
    if shape is None:
        text = (
            f"Predicted for {answer['world_size']} ranks from the run on {where}: ms per step "
            "and speedup over allreduce on each link; 'pays below': the link rate under which "
            "a hook steps faster than allreduce."
        )
        return textwrap.wrap(text, WIDTH) + _ladder_tables(predicted, rates) + [""]
    info = shape["shape"]
    text = (
        f"Predicted for {info['text']} from the run on {where}: bytes each machine's link "
        "sends per step, ms per step and speedup over allreduce on each link (each machine's "
        "link of that rate); 'pays below': the link rate under which a hook steps faster "
        "than allreduce."
    )
    return textwrap.wrap(text, WIDTH) + _ladder_tables(predicted, rates, info["key"]) + [""]


def answer_lines(rows: list[Row], answer: dict[str, Any], steps: int) -> list[str]:
    """The prediction for the ladder of links on each shape, then which hook to use on which
    link of each shape."""
    if "recommendations" not in answer:
        return [answer.get("prediction_note", "")]
    predicted = [r for r in rows if r.bandwidth is None and r.predicted]
    where = answer.get("measured_on", "loopback")
    shapes: list[dict[str, Any]] = answer.get("shapes") or []
    ladders: list[dict[str, Any] | None] = [*shapes] if shapes else [None]
    out = [line for shape in ladders for line in _shape_lines(predicted, shape, answer)]
    if "link" in answer:
        out += textwrap.wrap(answer["link"]["text"] + ".", WIDTH)
        out += textwrap.wrap(answer["on_your_network"]["text"], WIDTH)
    for measured in answer.get("on_measured_links", {}).values():  # --bandwidth's links
        out += textwrap.wrap(measured["text"], WIDTH)
    out += _recommendation_lines(answer, shapes)
    out += _caution_lines(predicted, answer, where, steps)
    return out


def _recommendation_lines(answer: dict[str, Any], shapes: list[dict[str, Any]]) -> list[str]:
    """Which hook on which link, per shape (predicted time to reach allreduce's loss)."""
    if len(shapes) < 2:
        out = ["Which hook on which link (predicted time to reach allreduce's loss):"]
        return out + ["  " + rec["text"] for rec in answer["recommendations"]]
    out = []
    for shape in shapes:
        out.append(f"Which hook on which link, {shape['shape']['text']} (predicted time to loss):")
        out += ["  " + rec["text"] for rec in shape["recommendations"]]
    return out


def _caution_lines(
    predicted: list[Row], answer: dict[str, Any], where: str, steps: int
) -> list[str]:
    out = []
    noisy = [r for r in predicted if r.noise.get("noisy")]
    if noisy:
        out += textwrap.wrap(
            f"Caution: {len(noisy)} of the {len(predicted)} rows on {where} every prediction "
            "comes from are noisy (see above); rerun with --repeat 3 --lockstep on a quiet "
            "machine before trusting these figures.",
            WIDTH,
            initial_indent="  ",
            subsequent_indent="  ",
        )
    unreached = answer.get("not_reaching_allreduce_loss")
    if unreached:
        out += textwrap.wrap(
            f"Did not reach allreduce's loss within {steps} steps, so never recommended: "
            f"{', '.join(unreached)}; more --steps may change the answer.",
            WIDTH,
            initial_indent="  ",
            subsequent_indent="  ",
        )
    return out


def sweep_lines(sweep: dict[str, Any]) -> list[str]:
    """Per hook, its measured speedup over allreduce on each link and the fitted break-even."""
    out = []
    for hook, info in sweep.items():
        measured = ", ".join(
            f"{format_rate(int(bw))}: {s:.2f}x"
            for bw, s in info["speedup_vs_allreduce"].items()
            if s is not None
        )
        be = info["break_even_bandwidth"]
        verdict = (f"break-even {format_rate(be)}; " if be else "") + info["verdict"]
        line = f"measured {hook}: " + "; ".join(x for x in (measured, verdict) if x)
        out += textwrap.wrap(line, WIDTH, subsequent_indent="  ")
    return out


def print_report(
    rows: list[Row],
    comparisons: dict[str, Any],
    answer: dict[str, Any],
    title: str,
    *,
    wide: bool,
    reach_steps: int,
    network: str = "loopback",
) -> None:
    """Print the results tables (every column if ``wide``), a sweep's measured speedups, then
    the answer, last; ``reach_steps``: how long the hooks had to reach allreduce's loss;
    ``network``: what the rows without a link rate ran on."""
    print("\n".join(results_lines(rows, title, wide, network)))
    if "sweep" in comparisons:
        print("\n".join(["", *sweep_lines(comparisons["sweep"])]))
    print()
    print("\n".join(answer_lines(rows, answer, reach_steps)))


def write_json(path: str, document: dict[str, Any]) -> None:
    """Write ``document`` atomically (a crash never leaves half a file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(document, f, indent=1, default=str)
    os.replace(tmp, path)
