"""Turn the ranks' raw figures into one result row per (hook, bandwidth), then compare rows:
ratios to ``allreduce`` and ``noop``, bytes against the analytic size, cost-model predictions,
and the sweep's speedups and break-even bandwidths."""

import math
import statistics
from typing import Any

from commhooks.bench import costmodel

__all__ = ["HEADER_BYTES", "analyse", "break_even_bps", "make_row"]

# Ethernet (14) + IPv4 (20) + TCP with timestamps (32): the headers every segment carries.
HEADER_BYTES = 66


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def pool_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from several runs of the same hook (``--repeat``).

    Each rank's timed steps, collective counters and link counters are pooled; the losses
    and the held-out loss are the first run's (every run trains the same model the same way),
    the peak memory the largest. A failed run makes the pooled run fail.
    """
    failed = [r for r in runs if not r["ok"]]
    if failed or len(runs) == 1:
        return failed[0] if failed else runs[0]
    pooled = []
    for per_rank in zip(*(r["ranks"] for r in runs)):
        first = per_rank[0]
        rank = {**first, "step_s": [s for r in per_rank for s in r["step_s"]]}
        rank["timed_steps"] = sum(r["timed_steps"] for r in per_rank)
        for key in ("payload_calls", "payload_bytes"):
            rank[key] = _sum_counts(r[key] for r in per_rank)
        wires = [r["wire"] for r in per_rank]
        rank["wire"] = _sum_counts(wires) if all(wires) else None
        rank["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in per_rank)
        pooled.append(rank)
    return {**runs[0], "ranks": pooled, "repeats": len(runs)}


def _sum_counts(dicts: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def make_row(hook: str, bandwidth: int | None, run: dict[str, Any], context: dict) -> dict:
    """One JSON result object from ``launcher.run_hook``'s output."""
    row: dict[str, Any] = {"hook": hook, "bandwidth": bandwidth, **context, "ok": run["ok"]}
    if not run["ok"]:
        row["error"] = run["error"]
        row["log_tail"] = run.get("log", "")[-3000:]
        for key in ("step_ms_median", "bytes_per_step", "heldout_loss", "peak_memory_bytes"):
            row[key] = None
        return row
    ranks = run["ranks"]
    world = len(ranks)
    steps = ranks[0]["timed_steps"]
    # A step ends for everyone at the slowest rank; take each rank's median, report the worst.
    per_rank_ms = [[s * 1e3 for s in r["step_s"]] for r in ranks]
    slowest = max(range(world), key=lambda i: statistics.median(per_rank_ms[i]))
    ms = per_rank_ms[slowest]
    calls = {k: v / steps for k, v in ranks[0]["payload_calls"].items()}
    payload = {k: v / steps for k, v in ranks[0]["payload_bytes"].items()}
    collectives = costmodel.Collectives(calls, payload)
    analytic = costmodel.wire_bytes(collectives, world)
    row.update(
        step_ms_median=statistics.median(ms),
        step_ms_p25=_quantile(ms, 0.25),
        step_ms_p75=_quantile(ms, 0.75),
        step_ms_min=min(ms),
        step_ms_max=max(ms),
        # the cost model predicts throughput, i.e. the mean: hooks that communicate only every
        # k-th step (model averaging) have a median that never sees those steps
        step_ms_mean=max(statistics.fmean(m) for m in per_rank_ms),
        step_ms=per_rank_ms,
        timed_steps=steps,
        repeats=run.get("repeats", 1),
        payload_calls_per_step=calls,
        payload_bytes_per_step=payload,
        analytic_bytes_per_step=analytic,
        gradient_bytes=ranks[0]["gradient_bytes"],
        heldout_loss=statistics.fmean(r["heldout_loss"] for r in ranks),
        heldout_loss_per_rank=[r["heldout_loss"] for r in ranks],
        peak_memory_bytes=max(r["peak_memory_bytes"] for r in ranks),
        peak_memory_bytes_per_rank=[r["peak_memory_bytes"] for r in ranks],
        losses=_mean_losses(ranks),
    )
    sent = sum(payload.values())
    row["compression_ratio"] = row["gradient_bytes"] / sent if sent else None
    wires = [r["wire"] for r in ranks]
    if all(wires):
        tx = statistics.fmean(w["tx_bytes"] for w in wires) / steps
        packets = statistics.fmean(w["tx_packets"] for w in wires) / steps
        tcp_payload = tx - packets * HEADER_BYTES
        row.update(
            bytes_per_step=tx,
            bytes_source="interface counters (bytes each rank's link sent, from its rate "
            "limiter: every wire-sized segment with its headers; mean over ranks)",
            wire=wires,
            wire_packets_per_step=packets,
            wire_payload_bytes_per_step=tcp_payload,
            wire_vs_analytic=tcp_payload / analytic if analytic else None,
        )
    else:
        row.update(
            bytes_per_step=analytic,
            bytes_source="payload counted in the ranks, ring allreduce model "
            "(loopback: no private interface to count)",
        )
    return row


def _mean_losses(ranks: list[dict]) -> list[list[float]]:
    """Per step: [step, mean training loss over ranks, rank 0's seconds since its first step]."""
    out = []
    for i, (step, _loss, t) in enumerate(ranks[0]["losses"]):
        mean = statistics.fmean(r["losses"][i][1] for r in ranks)
        out.append([step, mean, t])
    return out


def _fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares ``t = c + b * x``; returns (c, b) or None with fewer than 2 x values."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(t for _, t in points)
    b = sum((x - mx) * (t - my) for x, t in points) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def break_even_bps(hook_pts: list[tuple[float, float]], ref_pts: list[tuple[float, float]]):
    """Bandwidth where ``hook`` and the reference take equally long, from t = c + b / B fits.

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


def analyse(rows: list[dict], plan: Any) -> dict:
    """Add ratios and predictions to ``rows`` in place; return the run-level comparisons."""
    by_bw: dict[Any, dict[str, dict]] = {}
    for row in rows:
        by_bw.setdefault(row["bandwidth"], {})[row["hook"]] = row
    for _bw, table in by_bw.items():
        ref, floor = table.get("allreduce"), table.get("noop")
        for row in table.values():
            if not row["ok"]:
                continue
            for name, base in (("allreduce", ref), ("noop", floor)):
                good = base and base["ok"]
                row[f"time_vs_{name}"] = (
                    row["step_ms_median"] / base["step_ms_median"] if good else None
                )
            row["speedup_vs_allreduce"] = (
                1 / row["time_vs_allreduce"] if row["time_vs_allreduce"] else None
            )
            good = ref and ref["ok"]
            row["heldout_loss_vs_allreduce"] = (
                row["heldout_loss"] - ref["heldout_loss"] if good else None
            )
    out: dict[str, Any] = {}
    _predict(rows, by_bw, plan, out)
    if plan.sweep:
        out["sweep"] = _sweep(rows, by_bw)
    return out


def _collectives(row: dict) -> costmodel.Collectives:
    return costmodel.Collectives(row["payload_calls_per_step"], row["payload_bytes_per_step"])


def _predict(rows: list[dict], by_bw: dict, plan: Any, out: dict) -> None:
    """Fill in the cost model's predictions (of the mean step time, i.e. throughput).

    The compute floor is the fastest noop median over the measured networks, and each hook's
    own overhead (compression, averaging) the smallest excess of its measurement over floor
    plus modelled communication: minima, because a busy machine only ever adds time. Each row
    measured at a bandwidth then gets the model's prediction at that bandwidth, and the run
    gets the prediction at --predict."""
    floors = [r["step_ms_mean"] for r in rows if r["hook"] == "noop" and r["ok"]]
    if not floors:
        out["prediction_note"] = "predictions need a successful noop run (the compute floor)"
        return
    floor_s = min(floors) / 1e3
    latency = plan.latency_s
    overheads: dict[str, float] = {}
    fitted_at: dict[str, Any] = {}
    for row in rows:
        if not row["ok"]:
            continue
        bw = row["bandwidth"]
        comm = (
            0.0 if bw is None else costmodel.comm_time_s(_collectives(row), plan.ranks, bw, latency)
        )
        excess = max(0.0, row["step_ms_mean"] / 1e3 - floor_s - comm)
        if row["hook"] not in overheads or excess < overheads[row["hook"]]:
            overheads[row["hook"]], fitted_at[row["hook"]] = excess, bw
    for row in rows:
        if not row["ok"] or row["bandwidth"] is None:
            continue
        c, bw, hook = _collectives(row), row["bandwidth"], row["hook"]
        pred = costmodel.predict_step_s(floor_s, c, plan.ranks, bw, latency, overheads[hook])
        bare = costmodel.predict_step_s(floor_s, c, plan.ranks, bw, latency)
        row["prediction"] = {
            "step_ms": pred * 1e3,
            "measured_step_ms_mean": row["step_ms_mean"],
            "error": pred * 1e3 / row["step_ms_mean"] - 1,
            "overhead_ms": overheads[hook] * 1e3,
            "overhead_fitted_here": fitted_at[hook] == bw,
            "step_ms_without_overhead": bare * 1e3,
            "error_without_overhead": bare * 1e3 / row["step_ms_mean"] - 1,
        }
    if plan.predict_bps is None:
        return
    fastest = max(by_bw, key=lambda bw: math.inf if bw is None else bw)
    predicted = {}
    for hook, row in by_bw[fastest].items():
        if hook in overheads:
            s = costmodel.predict_step_s(
                floor_s,
                _collectives(row),
                plan.predict_world,
                plan.predict_bps,
                latency,
                overheads[hook],
            )
            predicted[hook] = {"step_ms": s * 1e3, "overhead_ms": overheads[hook] * 1e3}
    ref = predicted.get("allreduce")
    for p in predicted.values():
        p["speedup_vs_allreduce"] = ref["step_ms"] / p["step_ms"] if ref else None
    out["prediction"] = {
        "bandwidth": plan.predict_bps,
        "world_size": plan.predict_world,
        "latency_s": latency,
        "compute_floor_ms": floor_s * 1e3,
        "measured_at": fastest,
        "overhead_fitted_at": {h: fitted_at[h] for h in predicted},
        "hooks": predicted,
        "model": "t = noop floor + hook overhead + sum over collectives of "
        "2(p-1)/p * bytes * 8 / bandwidth * 1514/1448 + 2(p-1) * latency",
    }


def _sweep(rows: list[dict], by_bw: dict) -> dict:
    hooks = list(dict.fromkeys(r["hook"] for r in rows))
    points = {
        h: [(r["bandwidth"], r["step_ms_median"] / 1e3) for r in rows if r["hook"] == h and r["ok"]]
        for h in hooks
    }
    out = {}
    for h in hooks:
        speedups = {str(bw): t.get(h, {}).get("speedup_vs_allreduce") for bw, t in by_bw.items()}
        measured = [v for v in speedups.values() if v is not None]
        if h == "allreduce":
            bw, verdict = None, "the reference"
        elif not points.get("allreduce"):
            bw, verdict = None, "no speedup: add allreduce to --hooks to compare against it"
        elif measured and all(0.95 <= v <= 1.05 for v in measured):
            bw, verdict = None, "on par with allreduce (within 5%) at every measured bandwidth"
        else:
            bw, verdict = break_even_bps(points[h], points.get("allreduce", []))
        out[h] = {"speedup_vs_allreduce": speedups, "break_even_bandwidth": bw, "verdict": verdict}
    return out
