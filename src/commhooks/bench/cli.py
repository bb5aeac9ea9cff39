"""``commhooks bench``: run every selected hook on fresh ranks, per network, and report.

A run reads as its steps: say what will run, measure every hook on every network, turn the
ranks' figures into rows, compare them, predict, print, save. Under a launcher (torchrun) the
ranks are the launcher's and the network is the user's own (:mod:`commhooks.bench.launched`);
the rows it measures end the same way (:func:`conclude`).
"""

import dataclasses
import datetime
import os
import platform
import sys
import time
from contextlib import ExitStack
from typing import Any

from commhooks.bench import hookset, predict, report, summary
from commhooks.bench.args import Plan, parse
from commhooks.bench.launcher import run_hook, start_fork_server
from commhooks.bench.linkprobe import LinkMeasure
from commhooks.bench.netns import Network, NetworkError
from commhooks.bench.records import RunOutcome, RunSpec
from commhooks.bench.rows import Row, make_row, pool_memory_runs, pool_runs
from commhooks.bench.units import format_rate

__all__ = ["conclude", "main", "print_notes", "row_context", "run", "run_spec"]

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
Runs = dict[tuple[str, int | None], list[RunOutcome]]


def main(argv: list[str] | None = None) -> int:
    """Run the bench; return the exit status (0 when it ran, whatever the hooks did)."""
    plan = parse(argv)
    given = argv if argv is not None else sys.argv[1:]
    if plan.world is not None:
        from commhooks.bench import launched  # joins the launcher's process group

        launched.run(plan, given)
        return 0
    try:
        run(plan, given)
    except NetworkError as exc:
        print(f"commhooks bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("commhooks bench: interrupted; namespaces and links removed.", file=sys.stderr)
        return 130
    return 0


def run(plan: Plan, argv: list[str]) -> dict[str, Any]:
    """Run ``plan``; print the tables and the answer; write JSON/PNG when asked.

    Returns:
        the JSON document.
    """
    print_notes(plan)
    started = time.time()
    rows = _rows(plan, *_measure(plan))
    return conclude(plan, argv, rows, started)


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
        _title(plan),
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
    return f"your network ({plan.ranks} ranks, {plan.backend})"


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


class _Progress:
    """A progress bar (rich, when installed) or a line per run."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.bar: Any = None
        try:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            return
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
        )
        self.task = self.bar.add_task("starting rank processes", total=total)

    def starting(self, what: str) -> None:
        """Show what runs now."""
        if self.bar is not None:
            self.bar.update(self.task, description=what)

    def finished(self, line: str) -> None:
        """Count a run done and print its line."""
        self.done += 1
        if self.bar is None:
            print(f"[{self.done}/{self.total}] {line}", flush=True)
            return
        self.bar.console.print(line)
        self.bar.advance(self.task)

    def __enter__(self) -> "_Progress":
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _open_networks(plan: Plan, stack: ExitStack) -> dict[int | None, Network | None]:
    """Every network of the run, the links created now and removed when ``stack`` closes."""
    networks: dict[int | None, Network | None] = {None: None}
    for bandwidth in plan.bandwidths:
        if bandwidth is None:
            continue
        net = Network(plan.ranks, bandwidth, plan.latency_s, offload=plan.offload)
        networks[bandwidth] = stack.enter_context(net)
    return networks


def _measure(plan: Plan) -> tuple[Runs, Runs]:
    """Every hook on every network, ``plan.repeat`` times, each time also for its memory.

    Each hook runs on every network in turn before the next hook, and all of them in rounds:
    a drift of the machine's speed then shows in every figure alike, and a hook's loopback
    run, which its prediction comes from, is next in time to the link runs it is checked
    against. With ``--memory live``, each round also runs each hook once more per network,
    for its peak memory alone (its steps are slower, and not timed).
    """
    runs: Runs = {(h, bw): [] for bw in plan.networks for h in plan.hooks}
    memory: Runs = {key: [] for key in runs}
    live = plan.memory == "live"
    with ExitStack() as stack, _Progress(len(runs) * plan.repeat * (1 + live)) as progress:
        networks = _open_networks(plan, stack)
        start_fork_server()
        for round_ in range(plan.repeat):
            for hook in plan.hooks:
                for bw, net in networks.items():
                    where = format_rate(bw)
                    if plan.repeat > 1:
                        where += f", round {round_ + 1}/{plan.repeat}"
                    spec = run_spec(plan, hook, net)
                    runs[hook, bw].append(_run(plan, spec, net, where, progress))
                    if live:
                        spec = _memory_spec(plan, hook, net)
                        where += ", memory"
                        memory[hook, bw].append(_run(plan, spec, net, where, progress))
    return runs, memory


def _run(
    plan: Plan, spec: RunSpec, net: Network | None, where: str, progress: _Progress
) -> RunOutcome:
    progress.starting(f"{spec.hook} @ {where}")
    t0 = time.time()
    outcome = run_hook(spec, plan.ranks, net, plan.timeout_s)
    status = "ok" if outcome.ok else f"FAILED: {(outcome.error or '')[:120]}"
    progress.finished(f"{spec.hook} @ {where}: {time.time() - t0:.1f}s {status}")
    return outcome


def _bucket_cap_mb(plan: Plan, hook: str) -> float:
    single = hook in hookset.SINGLE_BUCKET_HOOKS
    return hookset.SINGLE_BUCKET_MB if single else plan.bucket_cap_mb


def _steps(plan: Plan, hook: str) -> int:
    """allreduce's steps for the references, more for the hooks that may reach its loss later."""
    reaching = hookset.recommendable(hook) and hook != "allreduce"
    return plan.reach_steps if reaching else plan.steps


def run_spec(plan: Plan, hook: str, net: Network | None) -> RunSpec:
    """What every rank is to do for ``hook`` (in ``net``'s namespaces, when given)."""
    return RunSpec(
        hook=hook,
        options=hookset.settings_for(hook),
        task=plan.task,
        params=plan.params,
        seed=plan.seed,
        steps=_steps(plan, hook),
        warmup=plan.warmup,
        heldout_at=plan.steps,
        measured_steps=plan.steps,
        lr=plan.lr,
        bucket_cap_mb=_bucket_cap_mb(plan, hook),
        lockstep=plan.lockstep,
        host_ends=net.host_ends if net is not None else None,
        fsdp=plan.fsdp,
        model=plan.model,
    )


def _memory_spec(plan: Plan, hook: str, net: Network | None) -> RunSpec:
    """The run for ``hook``'s peak memory: its measured steps, none beyond."""
    return dataclasses.replace(run_spec(plan, hook, net), steps=plan.steps, live_memory=True)


def row_context(plan: Plan, hook: str) -> dict[str, Any]:
    """The settings a row records beside its figures."""
    context: dict[str, Any] = {
        "options": hookset.settings_for(hook),
        "bucket_cap_mb": _bucket_cap_mb(plan, hook),
        "latency_s": plan.latency_s or None,
    }
    if hook in ("post_local_sgd", "torch_post_local_sgd"):
        context["averager_period"] = hookset.AVERAGER_PERIOD
    if hook in hookset.SINGLE_BUCKET_HOOKS:
        context["note"] = "single bucket so that PyTorch's PowerSGD completes on gloo"
    return context


def _rows(plan: Plan, runs: Runs, memory: Runs) -> list[Row]:
    return [
        make_row(
            hook,
            bw,
            pool_runs(runs[hook, bw]),
            row_context(plan, hook),
            pool_memory_runs(memory[hook, bw]) if memory[hook, bw] else None,
        )
        for bw in plan.networks
        for hook in plan.hooks
    ]


def _title(plan: Plan) -> str:
    rounds = f", {plan.repeat} rounds" if plan.repeat > 1 else ""
    what = f"--model {plan.model}" if plan.model else plan.task
    where = f" under a launcher ({plan.backend})" if plan.world is not None else ""
    return (
        f"commhooks bench: {what}, {plan.ranks} ranks{where}, {plan.steps} steps "
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

        write_plot(plan.plot_path, rows, answer, _title(plan))
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
        "backend": plan.backend,
        "launcher": dataclasses.asdict(plan.world) if plan.world is not None else None,
        # The link rate in bit/s (null: loopback only); a sweep lists each rate it ran.
        "bandwidth": (links[0] if len(links) == 1 else links) if links else None,
        "bandwidths": plan.networks,
        "latency_s": plan.latency_s or None,
        "network": _network_name(plan)
        if not links
        else "loopback, and one network namespace per rank, veth to a bridge, tc tbf on both "
        "ends of each link" + ("" if plan.offload else ", no segmentation offload"),
        "elapsed_s": elapsed,
    }
