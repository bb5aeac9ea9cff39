"""``commhooks bench``: run every selected hook on fresh ranks, per network, and report."""

import datetime
import os
import platform
import sys
import time
from contextlib import nullcontext
from typing import Any

from commhooks.bench import hookset, report, summary
from commhooks.bench.args import Plan, parse
from commhooks.bench.launcher import run_hook, start_server
from commhooks.bench.netns import Network, NetworkError, check_can_create
from commhooks.bench.units import format_rate

__all__ = ["main", "run"]

TORCH_SINGLE_BUCKET_NOTE = (
    "PyTorch's PowerSGD hooks run with a single DDP bucket (bucket_cap_mb={mb:g}): with several "
    "buckets they abort on gloo (follow-up collectives issued in a different order on each rank)."
)


def main(argv: list[str] | None = None) -> int:
    """Run the bench; return the exit status (0 when it ran, whatever the hooks did)."""
    plan = parse(argv)
    try:
        run(plan, argv if argv is not None else sys.argv[1:])
    except NetworkError as exc:
        print(f"commhooks bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("commhooks bench: interrupted; namespaces and links removed.", file=sys.stderr)
        return 130
    return 0


def _progress() -> Any:
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        transient=False,
    )


def _spec(plan: Plan, hook: str) -> tuple[dict[str, Any], dict[str, Any]]:
    options = hookset.settings_for(hook)
    single = hook in hookset.SINGLE_BUCKET_HOOKS
    bucket = hookset.SINGLE_BUCKET_MB if single else plan.bucket_cap_mb
    spec = {
        "world_size": plan.ranks,
        "task": plan.task,
        "params": plan.params,
        "seed": plan.seed,
        "steps": plan.steps,
        "warmup": plan.warmup,
        "hook": hook,
        "options": options,
        "bucket_cap_mb": bucket,
        "lr": plan.lr,
        "lockstep": plan.lockstep,
        "fsdp": plan.fsdp,
    }
    context = {"options": options, "bucket_cap_mb": bucket, "latency_s": plan.latency_s or None}
    if hook in ("post_local_sgd", "torch_post_local_sgd"):
        context["averager_period"] = hookset.AVERAGER_PERIOD
    if single:
        context["note"] = "single bucket so that PyTorch's PowerSGD completes on gloo"
    return spec, context


def run(plan: Plan, argv: list[str]) -> dict[str, Any]:
    """Run ``plan``; print the table; write JSON/PNG when asked. Returns the JSON document."""
    for name in plan.skipped:
        print(f"note: hook '{name}' is not registered in this build of commhooks; skipped.")
    for line in plan.notes:
        print(f"note: {line}")
    if any(bw is not None for bw in plan.bandwidths):
        check_can_create(plan.latency_s)
    if any(h in hookset.SINGLE_BUCKET_HOOKS for h in plan.hooks):
        print("note: " + TORCH_SINGLE_BUCKET_NOTE.format(mb=hookset.SINGLE_BUCKET_MB))
    for line in _setting_notes(plan):
        print(f"settings: {line}")
    started = time.time()
    rows: list[dict[str, Any]] = []
    total = len(plan.hooks) * len(plan.bandwidths) * plan.repeat
    done = 0
    progress = _progress()
    with progress or nullcontext():
        task = progress.add_task("starting rank processes", total=total) if progress else None
        start_server()
        for bw in plan.bandwidths:
            net = None
            if bw is not None:
                net = Network(plan.ranks, bw, plan.latency_s, offload=plan.offload)
            specs = {hook: _spec(plan, hook) for hook in plan.hooks}
            runs: dict[str, list[dict[str, Any]]] = {hook: [] for hook in plan.hooks}
            with net or nullcontext():
                # Rounds of every hook in turn: a drift of the machine's speed during the run
                # then shows in every hook's figures instead of in the last hooks' alone.
                for round_ in range(plan.repeat):
                    for hook in plan.hooks:
                        where = format_rate(bw)
                        if plan.repeat > 1:
                            where += f", round {round_ + 1}/{plan.repeat}"
                        if progress:
                            progress.update(task, description=f"{hook} @ {where}")
                        t0 = time.time()
                        result = run_hook(specs[hook][0], net, timeout=plan.timeout_s)
                        runs[hook].append(result)
                        done += 1
                        status = "ok" if result["ok"] else f"FAILED: {result['error'][:120]}"
                        line = f"{hook} @ {where}: {time.time() - t0:.1f}s {status}"
                        if progress:
                            progress.console.print(line)
                            progress.advance(task)
                        else:
                            print(f"[{done}/{total}] {line}", flush=True)
            for hook in plan.hooks:
                pooled = summary.pool_runs(runs[hook])
                rows.append(summary.make_row(hook, bw, pooled, specs[hook][1]))
    comparisons = summary.analyse(rows, plan)
    title = (
        f"commhooks bench: {plan.task}, {plan.ranks} ranks, {plan.steps} steps "
        f"({plan.warmup} untimed)" + (f", {plan.repeat} rounds" if plan.repeat > 1 else "")
    )
    report.print_table(rows, title)
    _print_comparisons(comparisons, plan)
    document = {
        "environment": _environment(plan, argv, time.time() - started),
        "settings": _settings(plan),
        "results": rows,
        **comparisons,
    }
    if plan.json_path:
        report.write_json(plan.json_path, document)
        print(f"wrote {plan.json_path}")
    if plan.plot_path:
        note = report.write_plot(plan.plot_path, rows, comparisons.get("sweep"))
        print(f"note: {note}" if note else f"wrote {plan.plot_path}")
    print(f"total time: {time.time() - started:.0f}s")
    return document


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
    if plan.fsdp:
        lines.append(
            "FSDP2: the model sharded per layer with fully_shard over a shard group of one rank "
            "(each rank a machine), the hook averaging the shards across ranks"
        )
    lines.append(f"{plan.steps} steps per hook, the first {plan.warmup} not timed")
    if plan.repeat > 1:
        lines.append(f"{plan.repeat} rounds of every hook in turn, each hook's timed steps pooled")
    if plan.lockstep:
        lines.append("lockstep: every step starts on all ranks together (untimed barrier)")
    if not plan.offload:
        lines.append("no segmentation offload: every packet is cut and reassembled in software")
    return lines


def _print_comparisons(comparisons: dict[str, Any], plan: Plan) -> None:
    for hook, info in comparisons.get("sweep", {}).items():
        sp = ", ".join(
            f"{format_rate(int(bw))}: {s:.2f}x"
            for bw, s in info["speedup_vs_allreduce"].items()
            if s is not None and bw != "None"
        )
        be = info["break_even_bandwidth"]
        be_text = f"break-even {format_rate(be)}; " if be else ""
        print(f"sweep {hook}: " + "; ".join(x for x in (sp, be_text + info["verdict"]) if x))
    pred = comparisons.get("prediction")
    if pred:
        print(
            f"prediction at {format_rate(pred['bandwidth'])}, {pred['world_size']} ranks "
            f"(ring allreduce model, measured at {format_rate(pred['measured_at'])}):"
        )
        for hook, p in pred["hooks"].items():
            sp = p["speedup_vs_allreduce"]
            print(
                f"  {hook}: {p['step_ms']:.1f} ms/step" + (f", {sp:.2f}x allreduce" if sp else "")
            )
    if comparisons.get("prediction_note"):
        print(f"note: {comparisons['prediction_note']}")


def _settings(plan: Plan) -> dict[str, Any]:
    return {
        "hooks": plan.hooks,
        "skipped_hooks": plan.skipped,
        "notes": plan.notes,
        "steps": plan.steps,
        "warmup_steps": plan.warmup,
        "repeat": plan.repeat,
        "lockstep": plan.lockstep,
        "offload": plan.offload,
        "fsdp": plan.fsdp,
        "task": plan.task,
        "lr": plan.lr,
        "seed": plan.seed,
        "bucket_cap_mb": plan.bucket_cap_mb,
        "powerSGD": hookset.POWERSGD_SETTINGS,
        "post_local_sgd": {**hookset.LOCALSGD_SETTINGS, "averager_period": hookset.AVERAGER_PERIOD},
        "torch_reference": TORCH_SINGLE_BUCKET_NOTE.format(mb=hookset.SINGLE_BUCKET_MB),
        "step_time": "wall-clock of zero_grad+forward+backward+optimizer step+averaging; median "
        "and quartiles of the slowest rank's timed steps",
        "peak_memory": "ru_maxrss at the end minus the resident set before the task was built; "
        "max over ranks",
    }


def _environment(plan: Plan, argv: list[str], elapsed: float) -> dict[str, Any]:
    import torch

    import commhooks

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": ["commhooks", "bench", *argv],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commhooks": commhooks.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "world_size": plan.ranks,
        "backend": "gloo",
        # The link rate in bit/s (null on loopback); a sweep lists each rate it ran.
        "bandwidth": plan.bandwidths[0] if len(plan.bandwidths) == 1 else plan.bandwidths,
        "bandwidths": plan.bandwidths,
        "latency_s": plan.latency_s or None,
        "network": "loopback"
        if plan.bandwidths == [None]
        else "one network namespace per rank, veth to a bridge, tc tbf on both ends of each link"
        + ("" if plan.offload else ", no segmentation offload"),
        "elapsed_s": elapsed,
    }
