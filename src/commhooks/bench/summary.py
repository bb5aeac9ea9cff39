"""Compare the rows measured on each network: ratios to ``allreduce`` and ``noop``, time to
``allreduce``'s loss, noise flags, and a sweep's measured speedups and break-even rates."""

import statistics
from collections.abc import Iterable
from typing import Any

from commhooks.bench.rows import Row

__all__ = [
    "LOSS_WINDOW",
    "NOISE_SUGGESTION",
    "SPREAD_LIMIT",
    "analyse",
    "by_network",
    "first_reaching",
    "fitted_break_even_bps",
    "smoothed",
]

LOSS_WINDOW = 5  # training losses averaged over this many steps before comparing them
# A median absolute deviation of the step times above this share of the median: the machine
# was busy, and ratios between hooks are not to be trusted.
SPREAD_LIMIT = 0.10
NOISE_SUGGESTION = (
    "rerun with --repeat 3 (hooks in turn, steps pooled) and --lockstep (every step starts on "
    "all ranks together), on a machine with nothing else running"
)


def by_network(rows: Iterable[Row]) -> dict[int | None, dict[str, Row]]:
    """The rows of each network, by hook."""
    out: dict[int | None, dict[str, Row]] = {}
    for row in rows:
        out.setdefault(row.bandwidth, {})[row.hook] = row
    return out


def analyse(rows: list[Row], sweep: bool) -> dict[str, Any]:
    """Add ratios, time to accuracy and noise flags to ``rows`` in place.

    Returns:
        the run-level comparisons: ``{"sweep": ...}`` when links of several rates were run.
    """
    for table in by_network(rows).values():
        reference, floor = table.get("allreduce"), table.get("noop")
        for row in table.values():
            if row.ok:
                _add_ratios(row, reference, floor)
                _add_time_to_loss(row, reference)
                _add_noise(row)
    return {"sweep": _sweep(rows)} if sweep else {}


def _ratio(row: Row, base: Row | None) -> float | None:
    if base is None or not base.ok or not base.step_ms_median or row.step_ms_median is None:
        return None
    return row.step_ms_median / base.step_ms_median


def _add_ratios(row: Row, reference: Row | None, floor: Row | None) -> None:
    row.time_vs_allreduce = _ratio(row, reference)
    row.time_vs_noop = _ratio(row, floor)
    row.speedup_vs_allreduce = 1 / row.time_vs_allreduce if row.time_vs_allreduce else None
    if reference is not None and reference.ok and reference.heldout_loss is not None:
        assert row.heldout_loss is not None
        row.heldout_loss_vs_allreduce = row.heldout_loss - reference.heldout_loss


def smoothed(values: list[float], window: int = LOSS_WINDOW) -> list[float | None]:
    """The mean of each value and the ``window - 1`` before it (``None`` until there are so many;
    a run shorter than ``window`` is averaged over what it has)."""
    window = max(1, min(window, len(values)))
    return [
        None if i + 1 < window else statistics.fmean(values[i + 1 - window : i + 1])
        for i in range(len(values))
    ]


def first_reaching(curve: list[float | None], target: float) -> int | None:
    """The first index at which ``curve`` is at or below ``target``."""
    return next((i for i, v in enumerate(curve) if v is not None and v <= target), None)


def _add_time_to_loss(row: Row, reference: Row | None) -> None:
    """The step and the seconds at which the row's training loss, averaged over
    ``LOSS_WINDOW`` steps, first reaches ``allreduce``'s final one (the same average)."""
    if reference is None or not reference.ok or not reference.losses:
        return
    window = min(LOSS_WINDOW, len(reference.losses))  # the same average on both sides
    target = smoothed([x[1] for x in reference.losses], window)[-1]
    if target is None:
        return
    at = first_reaching(smoothed([x[1] for x in row.losses], window), target)
    if at is not None:
        row.steps_to_allreduce_loss = at + 1
        row.time_to_allreduce_loss_s = row.losses[at][2]


def _add_noise(row: Row) -> None:
    """Flag a row whose figures a busy machine made unreliable, with what to do about it."""
    steps = max(row.step_ms, key=statistics.median)  # the slowest rank's, as the median's
    median = statistics.median(steps)
    deviation = statistics.median(abs(s - median) for s in steps)
    spread = deviation / median if median else 0.0
    reasons = []
    if spread > SPREAD_LIMIT:
        reasons.append(f"step times spread {spread:.0%} around their median")
    if row.time_vs_noop is not None and row.time_vs_noop < 1 and row.hook != "noop":
        reasons.append(f"faster than noop ({row.time_vs_noop:.2f}x), which communicates nothing")
    row.noise = {
        "noisy": bool(reasons),
        "relative_spread": spread,
        "reasons": reasons,
        "suggestion": NOISE_SUGGESTION if reasons else None,
    }


def _fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``t = c + b * x``; returns (c, b) or None with fewer than 2 x values."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(t for _, t in points)
    b = sum((x - mx) * (t - my) for x, t in points) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def fitted_break_even_bps(
    hook_pts: list[tuple[float, float]], ref_pts: list[tuple[float, float]]
) -> tuple[float | None, str]:
    """Bandwidth where ``hook`` and the reference take equally long, from t = c + b / B fits
    of measured points.

    Points are (bandwidth bit/s, step seconds). Returns (bandwidth or None, verdict): below the
    break-even the hook with fewer bytes per step wins, above it the one with less compute.
    """
    h = _fit([(1 / bw, t) for bw, t in hook_pts])
    r = _fit([(1 / bw, t) for bw, t in ref_pts])
    if h is None or r is None:
        return None, "needs at least two bandwidths"
    (ch, bh), (cr, br) = h, r
    if bh >= br and ch >= cr:
        return None, "never faster than allreduce in the measured model"
    if bh <= br and ch <= cr:
        return None, "faster than allreduce at every bandwidth"
    bw = (bh - br) / (cr - ch)
    if bw <= 0:
        return None, "no crossing at a positive bandwidth"
    side = "below" if bh < br else "above"
    return bw, f"faster than allreduce {side} the break-even bandwidth"


def _sweep(rows: list[Row]) -> dict[str, Any]:
    """Per hook: the measured speedup over allreduce on each link, and the break-even rate
    fitted to the measured points (loopback left out: it is not a link)."""
    links = [r for r in rows if r.bandwidth is not None]
    hooks = list(dict.fromkeys(r.hook for r in links))
    points = {
        h: [
            (float(r.bandwidth), r.step_ms_median / 1e3)
            for r in links
            if r.hook == h and r.ok and r.bandwidth is not None and r.step_ms_median is not None
        ]
        for h in hooks
    }
    out = {}
    for h in hooks:
        speedups = {str(r.bandwidth): r.speedup_vs_allreduce for r in links if r.hook == h}
        measured = [v for v in speedups.values() if v is not None]
        bw: float | None
        if h == "allreduce":
            bw, verdict = None, "the reference"
        elif not points.get("allreduce"):
            bw, verdict = None, "no speedup: add allreduce to --hooks to compare against it"
        elif measured and all(0.95 <= v <= 1.05 for v in measured):
            bw, verdict = None, "on par with allreduce (within 5%) at every measured bandwidth"
        else:
            bw, verdict = fitted_break_even_bps(points[h], points["allreduce"])
        out[h] = {"speedup_vs_allreduce": speedups, "break_even_bandwidth": bw, "verdict": verdict}
    return out
