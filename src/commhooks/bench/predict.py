"""The answer to "will compression pay off on my network?", from the loopback run.

Each hook's loopback row gives its step time and what it sent per step; the cost model
(:mod:`commhooks.bench.costmodel`) turns them into a step time on any link and cluster shape
(machines of several ranks, each machine with one link). From those, for every shape asked
for: each hook's predicted step time and speedup over ``allreduce`` on a ladder of link rates,
the bytes one machine's link sends per step, the rate below which it steps faster than
``allreduce``, and, per link, the hook that reaches ``allreduce``'s final training loss
soonest (its steps to that loss times its predicted step time). Rows measured on a real link
get the prediction for that link beside the measurement: a prediction never uses a
measurement on the link it is checked against.

Under a launcher the rows were measured on the user's own network, whose rate and latency an
allreduce sweep measured first (:mod:`commhooks.bench.linkprobe`): the model starts from each
row's step less that network's time for the bytes the hook sent (as if on loopback), and the
ladder's links get the measured latency.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

from commhooks.bench import costmodel, hookset, paths
from commhooks.bench.args import Plan
from commhooks.bench.linkprobe import LinkMeasure
from commhooks.bench.netns import burst_bytes
from commhooks.bench.rows import Row
from commhooks.bench.shape import Shape
from commhooks.bench.summary import by_network
from commhooks.bench.units import format_rate

__all__ = ["Model", "predict"]

MODEL_TEXT = (
    "t = loopback step - k * bytes a rank sent there + k * bytes a rank sends on the cluster "
    "+ the machines' links' time + rounds * latency; a machine's link sends, for a collective "
    "of S bytes over N machines of G ranks (W = N G), gloo's ring allreduce 2(W-1)/W * S, "
    "NCCL's 2(N-1)/N * S, an all-to-all G(N-1)/N * S, a ring all-gather (W-1)/W * S, the "
    "quantized average's two hops 2(N-1)/N * S_q; at 8 * bytes * (1514 + 66/2)/1448 / "
    "bandwidth; gloo's exchanges between two ranks take turns (all-to-all 2x, all-gather "
    "1.5x its bytes' time); k: the backend's CPU seconds per byte, from (allreduce - noop) / "
    "bytes on loopback"
)
_NOT_WORTH = 0.95  # a hook must save at least 5% of allreduce's time to be recommended over it


@dataclass(frozen=True)
class Model:
    """The cost model fitted to one loopback run.

    Attributes:
        measured: per hook, its mean loopback step and what it sent.
        s_per_byte: the backend's CPU seconds per byte sent (``costmodel.backend_s_per_byte``).
        latency_s: the one-way latency of the links predicted for.
        backend: the process groups' backend (gloo's exchanges take turns, NCCL's
            allreduce is topology-aware).
        intra_bps: the rate inside a machine (``--intra-link``); ``None``: free.
    """

    measured: dict[str, costmodel.LoopbackStep]
    s_per_byte: float
    latency_s: float
    backend: str = "gloo"
    intra_bps: float | None = None

    @classmethod
    def from_rows(
        cls,
        loopback: dict[str, Row],
        ranks: "int | Shape",
        latency_s: float,
        network: costmodel.Link | None = None,
        backend: str = "gloo",
        intra_bps: float | None = None,
    ) -> "Model":
        """Fit to the successful loopback ``rows`` of a run on ``ranks`` (a shape, or machines
        of one rank); ``network``: the link they were measured on instead (its time is taken
        out of each step)."""
        shape = ranks if isinstance(ranks, Shape) else Shape.of_ranks(ranks)
        measured = {}
        for hook, row in loopback.items():
            if not row.ok or row.step_ms_mean is None:
                continue
            step = _measured_step(row, shape)
            off = _off_link(step, backend, network)
            measured[hook] = dataclasses.replace(step, step_s=off)
        ref, floor = measured.get("allreduce"), measured.get("noop")
        k = costmodel.backend_s_per_byte(ref, floor) if ref and floor else 0.0
        return cls(measured, k, latency_s, backend, intra_bps)

    def cluster(self, shape: Shape) -> costmodel.Cluster:
        """``shape`` with this model's backend and inside of a machine."""
        return costmodel.Cluster(shape, self.backend, self.intra_bps)

    def _link(self, bandwidth_bps: float, burst: float = 0.0) -> costmodel.Link:
        return costmodel.Link(bandwidth_bps, self.latency_s, burst_bytes=burst)

    def step_s(
        self, hook: str, bandwidth_bps: float, shape: "int | Shape", burst: float = 0.0
    ) -> float:
        """The predicted mean step time of ``hook`` on ``shape`` (or that many ranks, each a
        machine), on links of ``bandwidth_bps`` with a token bucket of ``burst`` bytes."""
        link = self._link(bandwidth_bps, burst)
        target = self.cluster(_as_shape(shape))
        return costmodel.predicted_step_s(self.measured[hook], target, link, self.s_per_byte)

    def speedup(self, hook: str, bandwidth_bps: float, shape: "int | Shape") -> float | None:
        """``allreduce``'s predicted step time over ``hook``'s (``None`` without allreduce)."""
        if "allreduce" not in self.measured:
            return None
        ref = self.step_s("allreduce", bandwidth_bps, shape)
        return ref / self.step_s(hook, bandwidth_bps, shape)

    def break_even(self, hook: str, shape: "int | Shape") -> float | None:
        """The rate below which ``hook`` steps faster than ``allreduce`` (see the costmodel)."""
        return costmodel.break_even_bps(
            self.measured[hook],
            self.measured["allreduce"],
            self.cluster(_as_shape(shape)),
            self._link(1.0),
            self.s_per_byte,
        )

    def machine_bytes(self, hook: str, shape: Shape) -> float:
        """Payload bytes one machine's link sends per step of ``hook`` on ``shape``."""
        steps = costmodel.step_transfers(self.measured[hook], self.cluster(shape))
        return costmodel.machine_bytes(steps)


def _as_shape(shape: "int | Shape") -> Shape:
    return shape if isinstance(shape, Shape) else Shape.of_ranks(shape)


def _measured_step(row: Row, shape: Shape) -> costmodel.LoopbackStep:
    """The row's mean step and collectives on ``shape``, with the path its average takes."""
    hops = paths.two_hops_for(row.hook, row.options)
    # What a machine sums inside before the quantized hook's hop across: the gradients; a
    # DiLoCo sync sums a fragment now and then, left unpriced inside (free by default).
    summed = float(row.gradient_bytes or 0) if paths.sums_gradients(row.hook, hops) else 0.0
    return costmodel.LoopbackStep(
        row.step_ms_mean / 1e3 if row.step_ms_mean else 0.0,
        row.collectives(),
        shape,
        hops,
        summed,
    )


def _off_link(step: costmodel.LoopbackStep, backend: str, network: costmodel.Link | None) -> float:
    """``step``'s seconds less what ``network`` took for the bytes sent (never below zero)."""
    if network is None:
        return step.step_s
    cluster = costmodel.Cluster(step.shape, backend)
    comm = costmodel.link_time_s(costmodel.step_transfers(step, cluster), network, backend)
    return max(0.0, step.step_s - comm)


def network_of(answer: dict[str, Any]) -> costmodel.Link | None:
    """The network an answer's rows ran on (its ``link``, measured under a launcher) as the
    cost model's link, whose time the predictions take out of each step; its rate is of
    payload, so no headers."""
    link = answer.get("link") or {}
    if link.get("rate_bps") is None:
        return None
    return costmodel.Link(link["rate_bps"], link["latency_s"], wire_factor=1.0)


def predict(rows: list[Row], plan: Plan, link: LinkMeasure | None = None) -> dict[str, Any]:
    """Fill in every row's predictions; return the run's answer (for the JSON and the report).

    Rows get ``predicted`` (per ladder rate, as a string: step time and speedup over
    ``allreduce`` on the first shape of ``plan.shapes``), ``break_even_bps``, ``by_shape``
    (per shape: the bytes one machine's link sends per step, the ladder, the break-even), and,
    when measured on a link, ``prediction``: the loopback run's prediction for that link on
    the shape run, and its error against the measurement. ``link``: the user's network,
    measured under a launcher, on which the rows without a rate ran; it is in the answer as
    ``link``.
    """
    loopback = by_network(rows).get(None, {})
    latency = link.latency_s if link is not None else plan.latency_s
    network = network_of({"link": link.to_dict()} if link is not None else {})
    model = Model.from_rows(
        loopback, plan.shape, latency, network, plan.backend, plan.intra_link_bps
    )
    where = "loopback" if link is None else "your network"
    if not model.measured:
        note = f"no hook ran on {where}, so nothing could be predicted"
        return {"prediction_note": note, **({"link": link.to_dict()} if link else {})}
    for row in rows:
        if row.hook in model.measured:
            _add_predictions(row, model, plan)
    answer = _answer(model, loopback, plan, where, latency)
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


def _answer(
    model: Model, loopback: dict[str, Row], plan: Plan, where: str, latency: float
) -> dict[str, Any]:
    """The answer's figures: the first shape's as of old, every shape's under ``shapes``."""
    shapes = [_shape_answer(model, loopback, plan, shape) for shape in plan.shapes]
    first = shapes[0]
    return {
        "world_size": plan.shapes[0].ranks,
        "shape": first["shape"],
        "ranks_measured": plan.ranks,
        "shape_measured": _shape_dict(plan.shape),
        "backend": plan.backend,
        "intra_link_bps": plan.intra_link_bps,
        "measured_on": where,
        "latency_s": latency,
        "links": plan.links,
        "backend_ns_per_byte": model.s_per_byte * 1e9,
        "model": MODEL_TEXT,
        "recommendations": first["recommendations"],
        "shapes": shapes,
        "not_reaching_allreduce_loss": [
            h for h in _candidates(model) if loopback[h].steps_to_allreduce_loss is None
        ],
    }


def _shape_dict(shape: Shape) -> dict[str, Any]:
    return {
        "nodes": shape.nodes,
        "per_node": shape.per_node,
        "ranks": shape.ranks,
        "key": shape.key,
        "text": shape.text(),
    }


def _shape_answer(
    model: Model, loopback: dict[str, Row], plan: Plan, shape: Shape
) -> dict[str, Any]:
    """Per hook, the bytes a machine's link sends per step on ``shape``; which hook on which
    link there."""
    return {
        "shape": _shape_dict(shape),
        "machine_bytes_per_step": {h: model.machine_bytes(h, shape) for h in model.measured},
        "recommendations": [_recommend(model, loopback, bps, shape) for bps in plan.recommend_bps],
    }


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


def _ladder(model: Model, hook: str, links: list[int], shape: Shape) -> dict[str, Any]:
    return {
        str(bps): {
            "step_ms": model.step_s(hook, bps, shape) * 1e3,
            "speedup_vs_allreduce": model.speedup(hook, bps, shape),
        }
        for bps in links
    }


def _add_predictions(row: Row, model: Model, plan: Plan) -> None:
    first = plan.shapes[0]
    row.predicted = _ladder(model, row.hook, plan.links, first)
    if "allreduce" in model.measured:
        row.break_even_bps = model.break_even(row.hook, first)
    row.by_shape = {
        shape.key: {
            "machine_bytes_per_step": model.machine_bytes(row.hook, shape),
            "predicted": _ladder(model, row.hook, plan.links, shape),
            "break_even_bps": (
                model.break_even(row.hook, shape) if "allreduce" in model.measured else None
            ),
        }
        for shape in plan.shapes
    }
    if row.bandwidth is not None and row.ok and row.step_ms_mean:
        burst = burst_bytes(row.bandwidth)
        predicted = model.step_s(row.hook, row.bandwidth, plan.shape, burst) * 1e3
        row.prediction = {
            "step_ms": predicted,
            "measured_step_ms_mean": row.step_ms_mean,
            "error": predicted / row.step_ms_mean - 1,
            "from": "loopback",
            "world_size": plan.ranks,
            "shape": plan.shape.key,
            "machine_bytes_per_step": model.machine_bytes(row.hook, plan.shape),
        }


def _at_link(model: Model, bps: int, plan: Plan) -> dict[str, Any]:
    """Every hook's prediction at the user's own link (``--link``), in one place, per shape
    (the first shape's also as of old)."""
    per_shape = {
        shape.key: {
            hook: {
                "step_ms": model.step_s(hook, bps, shape) * 1e3,
                "speedup_vs_allreduce": model.speedup(hook, bps, shape),
                "machine_bytes_per_step": model.machine_bytes(hook, shape),
            }
            for hook in model.measured
        }
        for shape in plan.shapes
    }
    return {
        "bandwidth": bps,
        "world_size": plan.shapes[0].ranks,
        "shape": plan.shapes[0].key,
        "latency_s": model.latency_s,
        "hooks": per_shape[plan.shapes[0].key],
        "by_shape": per_shape,
    }


def _candidates(model: Model) -> list[str]:
    """The hooks measured that a user could train with."""
    return [h for h in model.measured if hookset.recommendable(h)]


def _recommend(model: Model, loopback: dict[str, Row], bps: int, shape: Shape) -> dict[str, Any]:
    """The hook predicted to reach ``allreduce``'s final loss soonest on ``shape`` with
    machines linked at ``bps``."""
    rate = format_rate(bps)
    out: dict[str, Any] = {"bandwidth": bps, "shape": shape.key, "hook": None}
    if "allreduce" not in loopback:
        out["text"] = f"{rate}: no answer: add allreduce to --hooks, every hook is compared with it"
        return out
    if "allreduce" not in model.measured or loopback["allreduce"].steps_to_allreduce_loss is None:
        out["text"] = f"{rate}: no answer: every hook is compared with allreduce, which failed"
        return out
    to_loss = {
        h: steps * model.step_s(h, bps, shape)
        for h in _candidates(model)
        if (steps := loopback[h].steps_to_allreduce_loss) is not None
    }
    best = min(to_loss, key=lambda h: to_loss[h])
    ratio = to_loss[best] / to_loss["allreduce"]
    if best == "allreduce" or ratio > _NOT_WORTH:
        out.update(hook="allreduce", time_to_loss_vs_allreduce=1.0, speedup_vs_allreduce=1.0)
        out["text"] = f"{rate}: allreduce; no hook reaches its loss 5% sooner"
        return out
    speedup = model.speedup(best, bps, shape) or 1.0
    out.update(hook=best, time_to_loss_vs_allreduce=ratio, speedup_vs_allreduce=speedup)
    pace = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    out["text"] = f"{rate}: {best}, {ratio:.2f}x allreduce's time, steps {pace}"
    return out
