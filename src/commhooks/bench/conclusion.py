"""How a bench run ends, whoever measured its rows: the notes printed before it starts, then
the comparisons, the predictions, the printed tables and answer, and the JSON and PNG files.
Shared by the local run (:mod:`.cli`) and the run under a launcher (:mod:`.launched`)."""

import dataclasses
import datetime
import os
import platform
import time
from typing import Any

from commhooks.bench import hookset, predict, report, summary
from commhooks.bench.args import Plan
from commhooks.bench.linkprobe import LinkMeasure
from commhooks.bench.rows import Row

__all__ = ["TORCH_SINGLE_BUCKET_NOTE", "conclude", "print_notes", "title"]


TORCH_SINGLE_BUCKET_NOTE = (
    "PyTorch's PowerSGD hooks run with a single DDP bucket (bucket_cap_mb={mb:g}): with several "
    "buckets they abort on gloo (follow-up collectives issued in a different order on each rank)."
)


_PEAK_MEMORY = {
    "live": "peak resident set of a run of its own with every allocation of 64 KiB or more "
    "mapped afresh and unmapped on free (what the steps hold live), up to the last measured "
    "step, minus the resident set before the task was built; median over rounds, max over "
    "ranks",
    "rss": "ru_maxrss at the end of the measured steps minus the resident set before the task "
    "was built (also what the allocator kept after frees); max over ranks and rounds",
}


def conclude(
    plan: Plan,
    argv: list[str],
    rows: list[Row],
    started: float,
    link: LinkMeasure | None = None,
) -> dict[str, Any]:
    """Compare and predict from the measured ``rows``, print the tables and the answer, write
    the JSON and PNG asked for; return the JSON document.

    ``link``: the user's own network, measured under a launcher; the rows were measured on it
    (``bandwidth`` ``None``), and the predictions start from them less its time.
    """
    comparisons = summary.analyse(rows, plan.sweep)
    answer = predict.predict(rows, plan, link)
    report.print_report(
        rows,
        comparisons,
        answer,
        title(plan),
        wide=plan.wide,
        reach_steps=plan.reach_steps,
        network=_network_name(plan),
    )
    document = _document(plan, argv, rows, comparisons, answer, time.time() - started)
    _write_outputs(plan, document, rows, answer)
    print(f"total time: {time.time() - started:.0f}s")
    return document


def _network_name(plan: Plan) -> str:
    """What the rows without a rate-limited link were measured on."""
    if plan.world is None:
        return "loopback"
    return f"your network ({plan.shape.text()}, {plan.backend})"


def print_notes(plan: Plan) -> None:
    """What the run adds, skips or fixes, before it starts."""
    for name in plan.skipped:
        print(f"note: hook '{name}' is not registered in this build of commhooks; skipped.")
    for line in plan.notes:
        print(f"note: {line}")
    if plan.bandwidths != [None]:
        print("note: every hook also runs on loopback: the predictions are made from there.")
    if any(h in hookset.SINGLE_BUCKET_HOOKS for h in plan.hooks):
        print("note: " + TORCH_SINGLE_BUCKET_NOTE.format(mb=hookset.SINGLE_BUCKET_MB))
    for line in _setting_notes(plan):
        print(f"settings: {line}")


def title(plan: Plan) -> str:
    """The report's first line: what ran, on which ranks (as which machines, where a machine
    holds several or a launcher started them), for how long."""
    rounds = f", {plan.repeat} rounds" if plan.repeat > 1 else ""
    what = f"--model {plan.model}" if plan.model else plan.task
    where = f" under a launcher ({plan.backend})" if plan.world is not None else ""
    ranks = f"{plan.ranks} ranks"
    if plan.world is not None or plan.shape.per_node > 1:
        ranks = plan.shape.text()
    return (
        f"commhooks bench: {what}, {ranks}{where}, {plan.steps} steps "
        f"({plan.warmup} untimed){rounds}"
    )


def _setting_notes(plan: Plan) -> list[str]:
    lines = []
    if any("power_sgd" in h for h in plan.hooks):
        ps = hookset.POWERSGD_SETTINGS
        lines.append(
            f"PowerSGD rank {ps['matrix_approximation_rank']}, plain allreduce for the first "
            f"{ps['start_powerSGD_iter']} steps (start_powerSGD_iter)"
        )
    if any("post_local_sgd" in h for h in plan.hooks):
        ls = hookset.LOCALSGD_SETTINGS
        lines.append(
            f"post-local SGD: global allreduce for {ls['start_localSGD_iter']} steps, then "
            f"local steps (post_local_gradient_allreduce={ls['post_local_gradient_allreduce']}) "
            f"with parameters averaged every {hookset.AVERAGER_PERIOD} steps"
        )
    if any("diloco" in h for h in plan.hooks):
        lines.append(
            f"DiLoCo: {hookset.DILOCO_SETTINGS}; streaming DiLoCo: "
            f"{hookset.STREAMING_DILOCO_SETTINGS} (each rank a worker; outer Nesterov SGD, "
            "lr 0.7, momentum 0.9)"
        )
    if plan.fsdp:
        lines.append(
            "FSDP2: the model sharded per layer with fully_shard over a shard group of one rank "
            "(each rank a machine), the hook averaging the shards across ranks"
        )
    lines.append(
        f"{plan.steps} steps for allreduce and the measuring hooks, {plan.reach_steps} for the "
        f"others (to see when they reach allreduce's loss); step times, bytes and memory from "
        f"step {plan.warmup + 1} to {plan.steps} for every hook, held-out loss after {plan.steps}"
    )
    if plan.repeat > 1:
        lines.append(f"{plan.repeat} rounds of every hook in turn, each hook's timed steps pooled")
    if plan.lockstep:
        lines.append("lockstep: every step starts on all ranks together (untimed barrier)")
    if plan.memory == "live":
        lines.append(
            "peak memory from one more run of each hook per network and round, with every "
            "allocation of 64 KiB or more mapped on its own (what the steps hold live; "
            "--memory rss: from the timed runs)"
        )
    if not plan.offload:
        lines.append("no segmentation offload: every packet is cut and reassembled in software")
    return lines


def _document(
    plan: Plan,
    argv: list[str],
    rows: list[Row],
    comparisons: dict[str, Any],
    answer: dict[str, Any],
    elapsed: float,
) -> dict[str, Any]:
    answer = dict(answer)
    at_link = answer.pop("prediction", None)
    document = {
        "environment": _environment(plan, argv, elapsed),
        "settings": _settings(plan),
        "results": [row.to_dict() for row in rows],
        "answer": answer,
        **comparisons,
    }
    if at_link is not None:
        document["prediction"] = at_link
    return document


def _write_outputs(
    plan: Plan, document: dict[str, Any], rows: list[Row], answer: dict[str, Any]
) -> None:
    if plan.json_path:
        report.write_json(plan.json_path, document)
        print(f"wrote {plan.json_path}")
    if plan.plot_path:
        from commhooks.bench.plot import write_plot  # imports matplotlib

        write_plot(plan.plot_path, rows, answer, title(plan))
        print(f"wrote {plan.plot_path}")


def _settings(plan: Plan) -> dict[str, Any]:
    return {
        "hooks": plan.hooks,
        "skipped_hooks": plan.skipped,
        "notes": plan.notes,
        "steps": plan.steps,
        "reach_steps": plan.reach_steps,
        "warmup_steps": plan.warmup,
        "repeat": plan.repeat,
        "lockstep": plan.lockstep,
        "memory": plan.memory,
        "offload": plan.offload,
        "fsdp": plan.fsdp,
        "task": plan.task if plan.model is None else None,
        "model": plan.model,
        "lr": plan.lr,
        "seed": plan.seed,
        "bucket_cap_mb": plan.bucket_cap_mb,
        "links": plan.links,
        "link": plan.predict_bps,
        "predicted_world_size": plan.predict_world,
        "predicted_shapes": [shape.key for shape in plan.shapes],
        "intra_link": plan.intra_link_bps,
        "powerSGD": hookset.POWERSGD_SETTINGS,
        "post_local_sgd": {**hookset.LOCALSGD_SETTINGS, "averager_period": hookset.AVERAGER_PERIOD},
        "torch_reference": TORCH_SINGLE_BUCKET_NOTE.format(mb=hookset.SINGLE_BUCKET_MB),
        "step_time": "zero_grad+forward+backward+optimizer step+averaging, on the device's "
        "clock (the host's on a CPU, CUDA events on a GPU); median and quartiles of the slowest "
        "rank's timed steps; host_step_ms_median: the host's own time to issue a step",
        "peak_memory": _PEAK_MEMORY[plan.memory],
        "peak_rss": _PEAK_MEMORY["rss"],
        "noise": f"a row is noisy when the median absolute deviation of its step times exceeds "
        f"{summary.SPREAD_LIMIT:.0%} of their median, or it is faster than noop",
    }


def _environment(plan: Plan, argv: list[str], elapsed: float) -> dict[str, Any]:
    import torch

    import commhooks

    links = [b for b in plan.bandwidths if b is not None]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": ["commhooks", "bench", *argv],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commhooks": commhooks.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "world_size": plan.ranks,
        "shape": {"nodes": plan.shape.nodes, "per_node": plan.shape.per_node},
        "backend": plan.backend,
        "launcher": dataclasses.asdict(plan.world) if plan.world is not None else None,
        # The link rate in bit/s (null: loopback only); a sweep lists each rate it ran.
        "bandwidth": (links[0] if len(links) == 1 else links) if links else None,
        "bandwidths": plan.networks,
        "latency_s": plan.latency_s or None,
        "network": _network_name(plan)
        if not links
        else f"loopback, and one network namespace per machine ({plan.shape.text()}), veth to "
        "a bridge, tc tbf on both ends of each link"
        + ("" if plan.offload else ", no segmentation offload"),
        "elapsed_s": elapsed,
    }
