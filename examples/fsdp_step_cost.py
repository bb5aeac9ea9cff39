"""What FSDP2 itself adds to a step, against DDP, and what that leaves of a hook's speedup.

``commhooks bench --fsdp`` compares each hook's speedup over ``allreduce`` under FSDP2 with
the same under DDP. On a slow link ``allreduce``'s step is the link's time under both, so the
ratio of the two speedups is the ratio of the compressed step times, DDP's over FSDP2's: every
millisecond FSDP2 adds to a step lowers it, whatever the hook does. This script measures those
milliseconds on the bench's model, with no link at all: the bench's trainers (DDP, and FSDP2 as
``commhooks bench --fsdp`` shards the model: a shard group of one rank, each rank a machine)
are built side by side in the same two ranks, and their steps interleave, one step of each in
turn, so that load on the machine falls on all of them alike::

    python examples/fsdp_step_cost.py --hooks noop,power_sgd,power_sgd_single_round --steps 40

For each hook it prints the median step time under DDP and under FSDP2 (the slower rank's),
their ratio, and the best ratio FSDP2 could reach for it if the hook cost exactly what it costs
under DDP: DDP's step over DDP's step plus what FSDP2 adds to ``noop``'s (no communication).
"""

import argparse
import statistics

import commhooks
from commhooks.bench import hookset, worker
from commhooks.bench.records import RunSpec
from commhooks.testing import run_on_ranks

WARMUP = 5


def _interleaved(
    rank: int, world_size: int, hooks: list[str], params: int, steps: int
) -> dict[str, list[float]]:
    trainers = {}
    for hook in hooks:
        for fsdp in (False, True):
            spec = RunSpec(
                hook=hook, options=hookset.settings_for(hook), task="synthetic", params=params,
                seed=0, steps=steps, warmup=WARMUP, heldout_at=steps, lr=1e-3, bucket_cap_mb=25,
                lockstep=True, fsdp=fsdp,
            )  # fmt: skip
            trainers[f"{hook}/{'fsdp' if fsdp else 'ddp'}"] = worker.build(spec, rank)
    for step in range(steps):
        for run in trainers.values():
            run.step(step, timed=step >= WARMUP)  # both ranks start each step together
    return {name: run.step_s for name, run in trainers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hooks", default="noop,power_sgd,power_sgd_single_round")
    parser.add_argument("--params", type=int, default=6_000_000, help="synthetic model size")
    parser.add_argument("--steps", type=int, default=40, help="steps of each trainer")
    args = parser.parse_args()
    hooks = ["noop"] + [h for h in args.hooks.split(",") if h and h != "noop"]
    unknown = [h for h in hooks if h not in commhooks.fsdp.hook_names()]
    if unknown:
        valid = ", ".join(commhooks.fsdp.hook_names())
        parser.error(f"--hooks: not hooks for FSDP2: {', '.join(unknown)}; choose from {valid}.")
    if args.steps <= WARMUP:
        parser.error(f"--steps must be above the {WARMUP} warm-up steps.")
    by_rank = run_on_ranks(
        _interleaved, 2, hooks, args.params, args.steps, timeout=60 + 5 * args.steps
    )
    median = {  # the slower rank's step, step by step
        name: 1e3 * statistics.median(map(max, *(r[name] for r in by_rank))) for name in by_rank[0]
    }
    added = median["noop/fsdp"] - median["noop/ddp"]
    print(f"{'hook':24} {'DDP ms':>8} {'FSDP2 ms':>9} {'DDP/FSDP2':>10} {'best':>6}")
    for hook in hooks:
        ddp, fsdp = median[f"{hook}/ddp"], median[f"{hook}/fsdp"]
        best = ddp / (ddp + added) if ddp + added > 0 else float("nan")
        print(f"{hook:24} {ddp:8.1f} {fsdp:9.1f} {ddp / fsdp:10.2f} {best:6.2f}")
    print(f"FSDP2 adds {added:.1f} ms to a step without communication ('noop').")


if __name__ == "__main__":
    main()
