"""The ``commhooks bench`` command line: flags, their validation, and the resolved plan."""

import argparse
import os
from dataclasses import dataclass, field

from commhooks.bench import hookset
from commhooks.bench.tasks import TASKS, parse_params
from commhooks.bench.units import RATE_FORM, parse_duration, parse_rate

__all__ = ["Plan", "build_parser", "parse"]

MAX_LOCAL_RANKS = 16


@dataclass
class Plan:
    """Everything a bench run needs, validated."""

    hooks: list[str]
    skipped: list[str]
    bandwidths: list[int | None]
    latency_s: float
    ranks: int
    steps: int
    warmup: int
    task: str
    params: int
    lr: float
    seed: int
    bucket_cap_mb: float
    timeout_s: float
    json_path: str | None
    plot_path: str | None
    predict_bps: int | None = None
    predict_world: int | None = None
    sweep: bool = False
    repeat: int = 1
    lockstep: bool = False
    offload: bool = True
    fsdp: bool = False
    notes: list[str] = field(default_factory=list)


def build_parser(prog: str = "commhooks bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train a small model on local ranks with each hook and compare step time, "
        "bytes on the wire, memory and held-out loss, optionally over a rate-limited network.",
    )
    p.add_argument(
        "--hooks",
        help="comma-separated hook names (default: "
        f"{','.join(hookset.DEFAULT_HOOKS)}); torch_* names run PyTorch's hooks, floor_sync, "
        "floor_wire and floor_memory what any PowerSGD design pays (see the README)",
    )
    p.add_argument(
        "--compare-torch",
        action="store_true",
        help="add PyTorch's own hooks (torch_fp16, torch_power_sgd, ...) as baselines",
    )
    p.add_argument("--steps", type=int, default=40, help="training steps per hook (default 40)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="first steps left out of the timing (default: 5, or half of --steps if fewer)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks to start (default 2); with --predict: the world size to predict for",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="ranks to start when --world-size names the predicted world (default 2)",
    )
    p.add_argument("--bandwidth", help=f"rate limit of every rank's link ({RATE_FORM}); needs root")
    p.add_argument("--latency", help="one-way delay between ranks, e.g. 5ms (needs netem)")
    p.add_argument("--sweep", help="comma-separated rates, e.g. 50mbit,100mbit,1gbit; needs root")
    p.add_argument("--predict", help="rate to predict step times at, e.g. 10gbit")
    p.add_argument(
        "--task",
        choices=TASKS,
        default="stdlib-lm",
        help="stdlib-lm (default: char transformer on Python's sources) or synthetic",
    )
    p.add_argument("--params", default="6M", help="synthetic task size (default 6M parameters)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=25.0,
        help="DDP bucket size for our hooks (default 25, DDP's)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the list of hooks this many times in turn and pool each hook's timed steps, "
        "so that a machine that slows down or speeds up during the run affects every hook "
        "alike (default 1)",
    )
    p.add_argument(
        "--lockstep",
        action="store_true",
        help="start every step on all ranks together (an untimed barrier), for every hook: "
        "ranks on one machine share its memory bandwidth, and a hook that never communicates "
        "lets them drift apart and share it better than any hook that does",
    )
    p.add_argument(
        "--no-offload",
        dest="offload",
        action="store_false",
        help="segment every packet in software, as a NIC without segmentation offload does "
        "(default: offload on, as on real NICs; the rate limit and byte counts are the same)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model with FSDP2 (each rank a machine, a shard group of one) and run "
        "the hooks through commhooks.fsdp.register, across the ranks",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per hook run")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--plot", dest="plot_path", metavar="PATH", help="write a PNG (matplotlib)")
    return p


def _fail(parser: argparse.ArgumentParser, message: str) -> None:
    parser.error(message)  # exits with status 2 and the usage line


def parse(argv: list[str] | None = None) -> Plan:
    """Parse and validate ``argv``; exit with a clear message on any bad flag."""
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return _plan(a, parser)
    except ValueError as exc:
        _fail(parser, str(exc))
        raise  # unreachable


def _rates(text: str, flag: str) -> list[int]:
    items = [t for t in (s.strip() for s in text.split(",")) if t]
    if not items:
        raise ValueError(f"{flag} needs at least one rate: use {RATE_FORM}.")
    return [parse_rate(t) for t in items]


def _plan(a: argparse.Namespace, parser: argparse.ArgumentParser) -> Plan:
    available = hookset.available_hooks()
    valid = available + list(hookset.TORCH_HOOKS) + list(hookset.FLOOR_HOOKS)
    skipped: list[str] = []
    if a.hooks is None:
        requested = list(hookset.DEFAULT_HOOKS)
        hooks = [h for h in requested if h in available]
        skipped = [h for h in requested if h not in available]
    else:
        names = (h.strip().lower() for h in a.hooks.split(","))  # CommHookType names, any case
        requested = list(dict.fromkeys(h for h in names if h))
        if not requested:
            raise ValueError(f"--hooks is empty; valid hooks: {', '.join(valid)}.")
        unknown = [h for h in requested if h not in valid]
        if unknown:
            raise ValueError(
                f"unknown hook(s) {', '.join(unknown)}; valid hooks: {', '.join(valid)}."
            )
        hooks = requested
    fsdp_notes: list[str] = []
    if a.fsdp:
        hooks, fsdp_notes = _for_fsdp(hooks, explicit=a.hooks is not None)
        if a.compare_torch:
            raise ValueError("--compare-torch runs PyTorch's DDP hooks, which FSDP2 has none of.")
    if a.compare_torch:
        hooks += hookset.torch_counterparts(requested)
    if not hooks:
        raise ValueError(f"no hook to run; valid hooks: {', '.join(valid)}.")

    if a.bandwidth and a.sweep:
        raise ValueError("give --bandwidth or --sweep, not both (a sweep lists every rate).")
    bandwidths: list[int | None] = [None]
    if a.bandwidth:
        bandwidths = [*_rates(a.bandwidth, "--bandwidth")]
        if len(bandwidths) > 1:
            raise ValueError("--bandwidth takes one rate; use --sweep for several.")
    if a.sweep:
        bandwidths = [*sorted(set(_rates(a.sweep, "--sweep")))]
    latency = parse_duration(a.latency) if a.latency else 0.0
    if latency and bandwidths == [None]:
        raise ValueError("--latency needs --bandwidth or --sweep (loopback has no link to delay).")
    if not a.offload and bandwidths == [None]:
        raise ValueError(
            "--no-offload needs --bandwidth or --sweep (loopback has no link to offload)."
        )
    if latency > 1.0:
        raise ValueError("--latency above 1s is not a network worth benchmarking; use e.g. 5ms.")

    predict_bps = parse_rate(a.predict) if a.predict else None
    notes = fsdp_notes + _add_references(
        hooks, sweep=bool(a.sweep), predict=predict_bps is not None
    )
    for flag, value in (("--world-size", a.world_size), ("--ranks", a.ranks)):
        if value is not None and value < 2:
            raise ValueError(f"{flag} must be at least 2 (a single rank communicates nothing).")
    if predict_bps is not None:
        predict_world = a.world_size or a.ranks or 2
        ranks = a.ranks or 2
    else:
        if a.ranks is not None and a.world_size is not None and a.ranks != a.world_size:
            raise ValueError(
                "--ranks and --world-size differ; without --predict they are the same."
            )
        predict_world = None
        ranks = a.ranks or a.world_size or 2
    if ranks > MAX_LOCAL_RANKS:
        raise ValueError(
            f"{ranks} ranks on one machine would measure the CPU, not the network; start at most "
            f"{MAX_LOCAL_RANKS} and model larger worlds with --predict RATE --world-size N."
        )
    if a.steps < 1:
        raise ValueError("--steps must be at least 1.")
    warmup = min(5, a.steps // 2) if a.warmup is None else a.warmup
    if not 0 <= warmup < a.steps:
        raise ValueError(
            f"--warmup {warmup} must be between 0 and --steps - 1 ({a.steps - 1}): at least one "
            "step has to be timed."
        )
    if a.bucket_cap_mb <= 0:
        raise ValueError("--bucket-cap-mb must be positive.")
    if a.timeout <= 0:
        raise ValueError("--timeout must be positive.")
    if not 1 <= a.repeat <= 100:
        raise ValueError("--repeat must be between 1 and 100.")
    lr = a.lr if a.lr is not None else (3e-3 if a.task == "stdlib-lm" else 1e-3)
    if lr <= 0:
        raise ValueError("--lr must be positive.")
    for flag, path in (("--json", a.json_path), ("--plot", a.plot_path)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"{flag} {path!r}: its directory does not exist.")
    if a.plot_path and not a.plot_path.lower().endswith(".png"):
        raise ValueError(f"--plot {a.plot_path!r}: give a .png path.")
    return Plan(
        hooks=hooks,
        skipped=skipped,
        bandwidths=bandwidths,
        latency_s=latency,
        ranks=ranks,
        steps=a.steps,
        warmup=warmup,
        task=a.task,
        params=parse_params(a.params),
        lr=lr,
        seed=a.seed,
        bucket_cap_mb=a.bucket_cap_mb,
        timeout_s=a.timeout,
        json_path=a.json_path,
        plot_path=a.plot_path,
        predict_bps=predict_bps,
        predict_world=predict_world,
        sweep=bool(a.sweep),
        repeat=a.repeat,
        lockstep=a.lockstep,
        offload=a.offload,
        fsdp=a.fsdp,
        notes=notes,
    )


def _for_fsdp(hooks: list[str], explicit: bool) -> tuple[list[str], list[str]]:
    """The hooks to run under ``--fsdp`` (those ``commhooks.fsdp.register`` takes), and notes.

    Hooks of the default list that it does not take are skipped with a note; hooks asked for by
    name are refused, naming the ones it takes.
    """
    from commhooks import fsdp

    valid = fsdp.hook_names()
    refused = [h for h in hooks if h not in valid]
    if refused and explicit:
        raise ValueError(
            f"--fsdp runs hooks through commhooks.fsdp.register, which does not take "
            f"{', '.join(refused)}; hooks for FSDP2: {', '.join(valid)}."
        )
    notes = [f"hook '{h}' does not apply to FSDP2 gradient shards; skipped" for h in refused]
    return [h for h in hooks if h in valid], notes


def _add_references(hooks: list[str], sweep: bool, predict: bool) -> list[str]:
    """Add, in place, the hooks a sweep or a prediction is computed against; say why.

    A sweep reports each hook's speedup over ``allreduce``, and a prediction builds on the
    ``noop`` compute floor: without them the figures asked for could not be given.
    """
    notes = []
    for needed, wanted, why in (
        ("noop", predict, "--predict builds on its compute floor"),
        ("allreduce", sweep, "--sweep reports each hook's speedup over it"),
    ):
        if wanted and needed not in hooks:
            hooks.insert(0 if needed == "noop" else min(1, len(hooks)), needed)
            notes.append(f"added hook '{needed}': {why}")
    return notes
