"""One result row per (hook, network), from what the ranks measured.

A :class:`Row` holds a hook's figures on one network: step times, bytes, losses, memory, and,
once :mod:`commhooks.bench.summary` and :mod:`commhooks.bench.predict` have compared the rows,
its ratios, time to accuracy, noise flags and predictions. It is what the table shows, the
plot draws, and the JSON's ``results`` list holds (``Row.to_dict``/``Row.from_dict``).
"""

import dataclasses
import math
import statistics
from collections.abc import Iterable
from typing import Any

from commhooks.bench import costmodel, paths
from commhooks.bench.records import RankResult, Record, RunOutcome
from commhooks.bench.shape import Shape

__all__ = ["HEADER_BYTES", "Row", "make_row", "pool_memory_runs", "pool_runs"]

# Ethernet (14) + IPv4 (20) + TCP with timestamps (32): the headers every segment carries.
HEADER_BYTES = 66
_LOG_CHARS = 3000


@dataclasses.dataclass
class Row(Record):
    """A hook's figures on one network (``bandwidth`` in bit/s; ``None``: loopback).

    Figures that could not be measured (a failed run, no link to count) are ``None``. Step
    times are the slowest rank's (a step ends for everyone when the slowest rank is done).
    """

    hook: str
    bandwidth: int | None
    ok: bool
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    bucket_cap_mb: float | None = None
    latency_s: float | None = None
    averager_period: int | None = None
    note: str | None = None
    error: str | None = None
    log_tail: str | None = None
    # step times, ms
    step_ms_median: float | None = None
    step_ms_p25: float | None = None
    step_ms_p75: float | None = None
    step_ms_min: float | None = None
    step_ms_max: float | None = None
    step_ms_mean: float | None = None
    step_ms: list[list[float]] = dataclasses.field(default_factory=list)
    timed_steps: int | None = None
    repeats: int = 1
    # where the ranks trained, and the host's own time per step: on a GPU the step times above
    # are the device's (CUDA events), and this is what Python and launching cost; on a CPU the
    # host does the work and the two agree
    device: str | None = None
    host_step_ms_median: float | None = None
    # bytes
    payload_calls_per_step: dict[str, float] = dataclasses.field(default_factory=dict)
    payload_bytes_per_step: dict[str, float] = dataclasses.field(default_factory=dict)
    analytic_bytes_per_step: float | None = None
    gradient_bytes: int | None = None
    compression_ratio: float | None = None
    bytes_per_step: float | None = None
    bytes_source: str | None = None
    wire: list[dict[str, int]] | None = None
    wire_packets_per_step: float | None = None
    wire_payload_bytes_per_step: float | None = None
    wire_vs_analytic: float | None = None
    # training
    heldout_loss: float | None = None
    heldout_loss_per_rank: list[float] = dataclasses.field(default_factory=list)
    # memory (bytes above the resident set before the task): the peak the steps hold live (the
    # hook's memory run, ``--memory live``) or, with ``--memory rss``, the timed runs' peak
    # resident set, which ``peak_rss_bytes`` always is
    peak_memory_bytes: int | None = None
    peak_memory_bytes_per_rank: list[int] = dataclasses.field(default_factory=list)
    peak_rss_bytes: int | None = None
    # on a GPU: torch.cuda.max_memory_allocated over the hook's run, max over ranks
    device_peak_memory_bytes: int | None = None
    losses: list[list[float]] = dataclasses.field(default_factory=list)
    # comparisons with the other rows (summary)
    time_vs_allreduce: float | None = None
    time_vs_noop: float | None = None
    speedup_vs_allreduce: float | None = None
    heldout_loss_vs_allreduce: float | None = None
    steps_to_allreduce_loss: int | None = None
    time_to_allreduce_loss_s: float | None = None
    noise: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the cost model's answer (predict)
    predicted: dict[str, dict[str, float | None]] = dataclasses.field(default_factory=dict)
    break_even_bps: float | None = None
    prediction: dict[str, Any] | None = None
    by_shape: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    shape: str | None = None

    def collectives(self) -> costmodel.Collectives:
        """What this hook's ranks handed to collectives per step."""
        return costmodel.Collectives(self.payload_calls_per_step, self.payload_bytes_per_step)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _sum_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in counts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _pool_rank(per_run: tuple[RankResult, ...]) -> RankResult:
    first = per_run[0]
    wires = [r.wire for r in per_run]
    return dataclasses.replace(
        first,
        step_s=[s for r in per_run for s in r.step_s],
        host_step_s=[s for r in per_run for s in r.host_step_s],
        payload_calls=_sum_counts(r.payload_calls for r in per_run),
        payload_bytes=_sum_counts(r.payload_bytes for r in per_run),
        wire=_sum_counts(w for w in wires if w) if all(wires) else None,
        peak_memory_bytes=max(r.peak_memory_bytes for r in per_run),
        device_peak_memory_bytes=_max_known(r.device_peak_memory_bytes for r in per_run),
    )


def _max_known(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def pool_runs(runs: list[RunOutcome]) -> RunOutcome:
    """One run's figures from several runs of the same hook (``--repeat``).

    Each rank's timed steps, collective counters and link counters are pooled; the losses
    and the held-out loss are the first run's (every run trains the same model the same way),
    the peak memory the largest. A failed run makes the pooled run fail.
    """
    failed = [r for r in runs if not r.ok]
    if failed or len(runs) == 1:
        return failed[0] if failed else runs[0]
    ranks = [_pool_rank(per_run) for per_run in zip(*(r.ranks for r in runs))]
    return RunOutcome(ok=True, ranks=ranks, repeats=len(runs))


def pool_memory_runs(runs: list[RunOutcome]) -> RunOutcome:
    """One memory run from a hook's memory runs of every round: each rank's median peak.

    A run now and then lands a few MiB off the others (about 2%, both ranks alike); the median
    of three leaves it out. A failed run makes the pooled run fail.
    """
    failed = [r for r in runs if not r.ok]
    if failed or len(runs) == 1:
        return failed[0] if failed else runs[0]
    ranks = [
        dataclasses.replace(
            per_run[0],
            peak_memory_bytes=round(statistics.median(r.peak_memory_bytes for r in per_run)),
        )
        for per_run in zip(*(r.ranks for r in runs))
    ]
    return RunOutcome(ok=True, ranks=ranks, repeats=len(runs))


def make_row(
    hook: str,
    bandwidth: int | None,
    run: RunOutcome,
    context: dict[str, Any],
    memory: RunOutcome | None = None,
    shape: Shape | None = None,
    backend: str = "gloo",
) -> Row:
    """The row of ``hook`` on ``bandwidth`` from its (pooled) run; ``context``: its settings.

    ``memory``: the hook's run for its peak memory (``RunSpec.live_memory``), if it had one;
    where that run failed, the row keeps the timed runs' peak and notes why. ``shape``: the
    machines the ranks ran as (default: each rank a machine), over ``backend``, whose links
    the bytes per step are of.
    """
    row = Row(hook=hook, bandwidth=bandwidth, ok=run.ok, **context)
    if not run.ok:
        row.error = run.error
        row.log_tail = run.log[-_LOG_CHARS:]
        return row
    _add_step_times(row, run.ranks)
    _add_device(row, run.ranks)
    row.repeats = run.repeats
    _add_bytes(row, run.ranks, shape or Shape.of_ranks(len(run.ranks)), backend)
    ranks = run.ranks
    row.heldout_loss = statistics.fmean(r.heldout_loss for r in ranks)
    row.heldout_loss_per_rank = [r.heldout_loss for r in ranks]
    row.peak_rss_bytes = max(r.peak_memory_bytes for r in ranks)
    _add_peak_memory(row, ranks if memory is None or not memory.ok else memory.ranks)
    if memory is not None and not memory.ok:
        failed = f"memory run failed ({memory.error}): peak memory from the timed runs"
        row.note = f"{row.note}; {failed}" if row.note else failed
    row.losses = _mean_losses(ranks)
    return row


def _add_peak_memory(row: Row, ranks: list[RankResult]) -> None:
    row.peak_memory_bytes = max(r.peak_memory_bytes for r in ranks)
    row.peak_memory_bytes_per_rank = [r.peak_memory_bytes for r in ranks]


def _add_step_times(row: Row, ranks: list[RankResult]) -> None:
    per_rank_ms = [[s * 1e3 for s in r.step_s] for r in ranks]
    slowest = max(range(len(ranks)), key=lambda i: statistics.median(per_rank_ms[i]))
    ms = per_rank_ms[slowest]
    row.step_ms_median = statistics.median(ms)
    row.step_ms_p25 = _quantile(ms, 0.25)
    row.step_ms_p75 = _quantile(ms, 0.75)
    row.step_ms_min = min(ms)
    row.step_ms_max = max(ms)
    # The cost model predicts throughput, i.e. the mean: hooks that communicate only every
    # k-th step (model averaging) have a median that never sees those steps.
    row.step_ms_mean = max(statistics.fmean(m) for m in per_rank_ms)
    row.step_ms = per_rank_ms
    row.timed_steps = ranks[0].timed_steps


def _add_device(row: Row, ranks: list[RankResult]) -> None:
    """Where the ranks trained, the slowest host's time per step, the device's peak memory."""
    row.device = ranks[0].device
    hosts = [statistics.median(r.host_step_s) for r in ranks if r.host_step_s]
    row.host_step_ms_median = max(hosts) * 1e3 if hosts else None
    row.device_peak_memory_bytes = _max_known(r.device_peak_memory_bytes for r in ranks)


def _add_bytes(row: Row, ranks: list[RankResult], shape: Shape, backend: str) -> None:
    first, steps = ranks[0], ranks[0].timed_steps
    row.payload_calls_per_step = {k: v / steps for k, v in first.payload_calls.items()}
    row.payload_bytes_per_step = {k: v / steps for k, v in first.payload_bytes.items()}
    if row.hook == "no" and not row.payload_bytes_per_step:
        # DDP's own allreduce is issued from C++, where no observer sees it: one allreduce of
        # every gradient per step is what it sends.
        row.payload_calls_per_step = {"all_reduce": 1.0}
        row.payload_bytes_per_step = {"all_reduce": float(first.gradient_bytes)}
    analytic = _machine_bytes(row, shape, backend)
    row.shape = shape.key
    row.analytic_bytes_per_step = analytic
    row.gradient_bytes = first.gradient_bytes
    sent = sum(row.payload_bytes_per_step.values())
    row.compression_ratio = first.gradient_bytes / sent if sent else None
    wires = [r.wire for r in ranks]
    if not all(wires):
        row.bytes_per_step = analytic
        row.bytes_source = (
            "payload counted in the ranks, per machine link by the cost model's algorithms "
            "(no private interface to count)"
        )
        return
    tx = statistics.fmean(w["tx_bytes"] for w in wires if w) / steps
    packets = statistics.fmean(w["tx_packets"] for w in wires if w) / steps
    row.bytes_per_step = tx
    row.bytes_source = (
        "interface counters (bytes each machine's link sent, from its rate limiter: every "
        "wire-sized segment with its headers; mean over ranks)"
    )
    row.wire = [w for w in wires if w]
    row.wire_packets_per_step = packets
    row.wire_payload_bytes_per_step = tx - packets * HEADER_BYTES
    row.wire_vs_analytic = row.wire_payload_bytes_per_step / analytic if analytic else None


def _machine_bytes(row: Row, shape: Shape, backend: str) -> float:
    """What one machine's link sends per step, from the collectives counted (payload model)."""
    hops = paths.two_hops(row.hook, row.options, shape)
    steps = costmodel.transfers(row.collectives(), shape, shape, backend, hops, hops)
    return costmodel.machine_bytes(steps)


def _mean_losses(ranks: list[RankResult]) -> list[list[float]]:
    """Per step: [step, mean training loss over ranks, rank 0's seconds since its first step]."""
    out = []
    for i, (step, _loss, t) in enumerate(ranks[0].losses):
        mean = statistics.fmean(r.losses[i][1] for r in ranks)
        out.append([step, mean, t])
    return out
