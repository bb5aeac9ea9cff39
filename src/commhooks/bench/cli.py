"""``commhooks bench``: run every selected hook on fresh ranks, per network, and report.

A run reads as its steps: say what will run, measure every hook on every network, turn the
ranks' figures into rows, compare them, predict, print, save. Under a launcher (torchrun) the
ranks are the launcher's and the network is the user's own (:mod:`commhooks.bench.launched`);
the rows it measures end the same way (:func:`conclude`).
"""

import sys
import time
from contextlib import ExitStack
from typing import Any

import torch

from commhooks.bench.args import Plan, parse
from commhooks.bench.conclusion import conclude, print_notes
from commhooks.bench.launcher import run_hook, start_fork_server
from commhooks.bench.netns import Network, NetworkError
from commhooks.bench.records import RunOutcome, RunSpec
from commhooks.bench.rows import Row, make_row, pool_memory_runs, pool_runs
from commhooks.bench.specs import memory_spec, row_context, run_spec
from commhooks.bench.units import format_rate
from commhooks.bench.usermodel import BenchModelError, check_factory

__all__ = ["conclude", "main", "print_notes", "row_context", "run", "run_spec"]  # old homes

Runs = dict[tuple[str, int | None], list[RunOutcome]]


def main(argv: list[str] | None = None) -> int:
    """Run the bench; return the exit status (0 when it ran, whatever the hooks did; 2 for a
    ``--model`` it cannot train or a network it cannot build, said in one line)."""
    plan = parse(argv)
    given = argv if argv is not None else sys.argv[1:]
    if plan.world is not None:
        from commhooks.bench import launched  # joins the launcher's process group

        try:
            launched.run(plan, given)
        except launched.ModelRefused:  # the launcher's rank 0 has said why
            return 2
        return 0
    try:
        if plan.model is not None:  # once, here, before every hook's ranks would fail alike
            check_factory(plan.model, plan.seed, torch.device("cpu"))
        run(plan, given)
    except (NetworkError, BenchModelError) as exc:
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
        shape = plan.shape
        net = Network(
            shape.nodes, bandwidth, plan.latency_s, offload=plan.offload, per_node=shape.per_node
        )
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
                        spec = memory_spec(plan, hook, net)
                        where += ", memory"
                        memory[hook, bw].append(_run(plan, spec, net, where, progress))
    return runs, memory


def _run(
    plan: Plan, spec: RunSpec, net: Network | None, where: str, progress: _Progress
) -> RunOutcome:
    progress.starting(f"{spec.hook} @ {where}")
    t0 = time.time()
    outcome = run_hook(spec, plan.shape, net, plan.timeout_s)
    status = "ok" if outcome.ok else f"FAILED: {(outcome.error or '')[:120]}"
    progress.finished(f"{spec.hook} @ {where}: {time.time() - t0:.1f}s {status}")
    return outcome


def _rows(plan: Plan, runs: Runs, memory: Runs) -> list[Row]:
    return [
        make_row(
            hook,
            bw,
            pool_runs(runs[hook, bw]),
            row_context(plan, hook),
            pool_memory_runs(memory[hook, bw]) if memory[hook, bw] else None,
            plan.shape,
            plan.backend,
        )
        for bw in plan.networks
        for hook in plan.hooks
    ]
