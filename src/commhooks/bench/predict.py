"""The answer to "will compression pay off on my network?", from the loopback run.

Each hook's loopback row gives its step time and what it sent per step; the cost model
(:mod:`commhooks.bench.costmodel`) turns them into a step time on any link and world size.
From those: each hook's predicted step time and speedup over ``allreduce`` on a ladder of
link rates, the rate below which it steps faster than ``allreduce``, and, per link, the hook
that reaches ``allreduce``'s final training loss soonest (its steps to that loss times its
predicted step time). Rows measured on a real link get the prediction for that link beside
the measurement: a prediction never uses a measurement on the link it is checked against.

Under a launcher the rows were measured on the user's own network, whose rate and latency an
allreduce sweep measured first (:mod:`commhooks.bench.linkprobe`): the model starts from each
row's step less that network's time for the bytes the hook sent (as if on loopback), and the
ladder's links get the measured latency.
"""

from dataclasses import dataclass
from typing import Any

from commhooks.bench import costmodel, hookset
from commhooks.bench.args import Plan
from commhooks.bench.linkprobe import LinkMeasure
from commhooks.bench.rows import Row
from commhooks.bench.summary import by_network
from commhooks.bench.units import format_rate

__all__ = ["Model", "predict"]

MODEL_TEXT = (
    "t = loopback step - k * bytes sent there + k * bytes sent at world size p "
    "+ 8 * bytes * (1514 + 66/2)/1448 / bandwidth + rounds * latency (headers and TCP "
    "acknowledgements on an Ethernet link); per allreduce of n bytes a rank "
    "sends 2(p-1)/p * n in 2(p-1) rounds; k: the backend's CPU seconds per byte, from "
    "(allreduce - noop) / bytes on loopback"
)
_NOT_WORTH = 0.95  # a hook must save at least 5% of allreduce's time to be recommended over it


@dataclass(frozen=True)
class Model:
    """The cost model fitted to one loopback run.

    Attributes:
        measured: per hook, its mean loopback step and what it sent.
        s_per_byte: the backend's CPU seconds per byte sent (``costmodel.backend_s_per_byte``).
        latency_s: the one-way latency of the links predicted for.
    """

    measured: dict[str, costmodel.LoopbackStep]
    s_per_byte: float
    latency_s: float

    @classmethod
    def from_rows(
        cls,
        loopback: dict[str, Row],
        ranks: int,
        latency_s: float,
        network: costmodel.Link | None = None,
    ) -> "Model":
        """Fit to the successful loopback ``rows`` of a run on ``ranks`` ranks; ``network``:
        the link they were measured on instead (its time is taken out of each step)."""
        measured = {
            hook: costmodel.LoopbackStep(
                _off_link(row.step_ms_mean / 1e3, row.collectives(), ranks, network),
                row.collectives(),
                ranks,
            )
            for hook, row in loopback.items()
            if row.ok and row.step_ms_mean is not None
        }
        ref, floor = measured.get("allreduce"), measured.get("noop")
        k = costmodel.backend_s_per_byte(ref, floor) if ref and floor else 0.0
        return cls(measured, k, latency_s)

    def _link(self, bandwidth_bps: float) -> costmodel.Link:
        return costmodel.Link(bandwidth_bps, self.latency_s)

    def step_s(self, hook: str, bandwidth_bps: float, world_size: int) -> float:
        """The predicted mean step time of ``hook``."""
        link = self._link(bandwidth_bps)
        return costmodel.predicted_step_s(self.measured[hook], world_size, link, self.s_per_byte)

    def speedup(self, hook: str, bandwidth_bps: float, world_size: int) -> float | None:
        """``allreduce``'s predicted step time over ``hook``'s (``None`` without allreduce)."""
        if "allreduce" not in self.measured:
            return None
        ref = self.step_s("allreduce", bandwidth_bps, world_size)
        return ref / self.step_s(hook, bandwidth_bps, world_size)

    def break_even(self, hook: str, world_size: int) -> float | None:
        """The rate below which ``hook`` steps faster than ``allreduce`` (see the costmodel)."""
        return costmodel.break_even_bps(
            self.measured[hook],
            self.measured["allreduce"],
            world_size,
            self._link(1.0),
            self.s_per_byte,
        )


def _off_link(
    step_s: float, c: costmodel.Collectives, ranks: int, network: costmodel.Link | None
) -> float:
    """``step_s`` less what ``network`` took for the bytes sent (never below zero)."""
    if network is None:
        return step_s
    comm = costmodel.comm_time_s(
        c, ranks, network.bandwidth_bps, network.latency_s, network.wire_factor
    )
    return max(0.0, step_s - comm)


def _measured_network(link: LinkMeasure | None) -> costmodel.Link | None:
    """The measured network as the cost model's link: its rate is of payload, so no headers."""
    if link is None or link.rate_bps is None:
        return None
    return costmodel.Link(link.rate_bps, link.latency_s, wire_factor=1.0)


def predict(rows: list[Row], plan: Plan, link: LinkMeasure | None = None) -> dict[str, Any]:
    """Fill in every row's predictions; return the run's answer (for the JSON and the report).

    Rows get ``predicted`` (per ladder rate, as a string: step time and speedup over
    ``allreduce`` at ``plan.predict_world``), ``break_even_bps``, and, when measured on a
    link, ``prediction``: the loopback run's prediction for that link at the ranks run, and
    its error against the measurement. ``link``: the user's network, measured under a
    launcher, on which the rows without a rate ran; it is in the answer as ``link``.
    """
    loopback = by_network(rows).get(None, {})
    latency = link.latency_s if link is not None else plan.latency_s
    model = Model.from_rows(loopback, plan.ranks, latency, _measured_network(link))
    where = "loopback" if link is None else "your network"
    if not model.measured:
        note = f"no hook ran on {where}, so nothing could be predicted"
        return {"prediction_note": note, **({"link": link.to_dict()} if link else {})}
    for row in rows:
        if row.hook in model.measured:
            _add_predictions(row, model, plan)
    answer: dict[str, Any] = {
        "world_size": plan.predict_world,
        "ranks_measured": plan.ranks,
        "measured_on": where,
        "latency_s": latency,
        "links": plan.links,
        "backend_ns_per_byte": model.s_per_byte * 1e9,
        "model": MODEL_TEXT,
        "recommendations": [_recommend(model, loopback, b, plan) for b in plan.recommend_bps],
        "not_reaching_allreduce_loss": [
            h for h in _candidates(model) if loopback[h].steps_to_allreduce_loss is None
        ],
    }
    if plan.predict_bps is not None:
        answer["prediction"] = _at_link(model, plan.predict_bps, plan)
    if link is not None:
        answer["link"] = link.to_dict()
        answer["on_your_network"] = _measured_best(loopback)
    measured_links = {
        str(bps): _measured_best(table, f"On the {format_rate(bps)} link, measured")
        for bps, table in by_network(rows).items()
        if bps is not None
    }
    if measured_links:
        answer["on_measured_links"] = measured_links
    return answer


def _s(seconds: float) -> str:
    return f"{seconds:.3g}s"


def _measured_best(measured: dict[str, Row], lead: str = "On it, measured") -> dict[str, Any]:
    """The hook that reached ``allreduce``'s final loss soonest on the network measured (not
    predicted), with its time against ``allreduce``'s; ``lead`` opens its text."""
    out: dict[str, Any] = {"hook": None}
    reference = measured.get("allreduce")
    ref_s = reference.time_to_allreduce_loss_s if reference and reference.ok else None
    reached = {
        h: r.time_to_allreduce_loss_s
        for h, r in measured.items()
        if r.ok and r.time_to_allreduce_loss_s is not None and hookset.recommendable(h)
    }
    if not ref_s or not reached:
        out["text"] = f"{lead}: no answer (allreduce failed, or no hook reached its loss)."
        return out
    best = min(reached, key=lambda h: reached[h] or 0.0)
    best_s = reached[best] or 0.0
    if best_s / ref_s > _NOT_WORTH:
        best, best_s = "allreduce", ref_s
    ratio = best_s / ref_s
    out.update(hook=best, time_to_allreduce_loss_s=best_s, time_to_loss_vs_allreduce=ratio)
    out["text"] = (
        f"{lead}: use {best}; it reached allreduce's loss in {best_s:.1f}s, "
        f"{ratio:.2f}x allreduce's {ref_s:.1f}s."
        if best != "allreduce"
        else f"{lead}: allreduce ({ref_s:.1f}s to its loss); no hook reached it 5% sooner."
    )
    return out


def _add_predictions(row: Row, model: Model, plan: Plan) -> None:
    world = plan.predict_world
    row.predicted = {
        str(bps): {
            "step_ms": model.step_s(row.hook, bps, world) * 1e3,
            "speedup_vs_allreduce": model.speedup(row.hook, bps, world),
        }
        for bps in plan.links
    }
    if "allreduce" in model.measured:
        row.break_even_bps = model.break_even(row.hook, world)
    if row.bandwidth is not None and row.ok and row.step_ms_mean:
        predicted = model.step_s(row.hook, row.bandwidth, plan.ranks) * 1e3
        row.prediction = {
            "step_ms": predicted,
            "measured_step_ms_mean": row.step_ms_mean,
            "error": predicted / row.step_ms_mean - 1,
            "from": "loopback",
            "world_size": plan.ranks,
        }


def _at_link(model: Model, bps: int, plan: Plan) -> dict[str, Any]:
    """Every hook's prediction at the user's own link (``--link``), in one place."""
    world = plan.predict_world
    return {
        "bandwidth": bps,
        "world_size": world,
        "latency_s": model.latency_s,
        "hooks": {
            hook: {
                "step_ms": model.step_s(hook, bps, world) * 1e3,
                "speedup_vs_allreduce": model.speedup(hook, bps, world),
            }
            for hook in model.measured
        },
    }


def _candidates(model: Model) -> list[str]:
    """The hooks measured that a user could train with."""
    return [h for h in model.measured if hookset.recommendable(h)]


def _recommend(model: Model, loopback: dict[str, Row], bps: int, plan: Plan) -> dict[str, Any]:
    """The hook predicted to reach ``allreduce``'s final loss soonest on a ``bps`` link."""
    world, rate = plan.predict_world, format_rate(bps)
    out: dict[str, Any] = {"bandwidth": bps, "hook": None}
    if "allreduce" not in loopback:
        out["text"] = f"{rate}: no answer: add allreduce to --hooks, every hook is compared with it"
        return out
    if "allreduce" not in model.measured or loopback["allreduce"].steps_to_allreduce_loss is None:
        out["text"] = f"{rate}: no answer: every hook is compared with allreduce, which failed"
        return out
    to_loss = {
        h: steps * model.step_s(h, bps, world)
        for h in _candidates(model)
        if (steps := loopback[h].steps_to_allreduce_loss) is not None
    }
    best = min(to_loss, key=lambda h: to_loss[h])
    ratio = to_loss[best] / to_loss["allreduce"]
    if best == "allreduce" or ratio > _NOT_WORTH:
        out.update(hook="allreduce", time_to_loss_vs_allreduce=1.0, speedup_vs_allreduce=1.0)
        out["text"] = f"{rate}: allreduce; no hook reaches its loss 5% sooner"
        return out
    speedup = model.speedup(best, bps, world) or 1.0
    out.update(hook=best, time_to_loss_vs_allreduce=ratio, speedup_vs_allreduce=speedup)
    pace = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    out["text"] = f"{rate}: {best}, {ratio:.2f}x allreduce's time, steps {pace}"
    return out
