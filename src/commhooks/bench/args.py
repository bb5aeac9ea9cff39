"""The ``commhooks bench`` command line: flags, their validation, and the resolved plan."""

import argparse
import importlib.util
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Literal, get_args

from commhooks.bench import footprint, hookset
from commhooks.bench.shape import Shape
from commhooks.bench.tasks import TASKS, parse_params
from commhooks.bench.units import RATE_FORM, parse_duration, parse_rate
from commhooks.bench.world import LauncherWorld, launcher_world
from commhooks.options import suggest

__all__ = ["BACKENDS", "DEFAULT_LADDER", "MEMORY_MEASURES", "Plan", "build_parser", "parse"]

MAX_LOCAL_RANKS = 16
# A hook that loses a little per step (PowerSGD) reaches allreduce's final loss some steps
# later; within this many times allreduce's steps, the time it takes is worth knowing.
REACH_FACTOR = 2.5
DEFAULT_LADDER = "100mbit,1gbit,10gbit,25gbit"
PLOT_INSTALL = "pip install matplotlib (or pip install -e '.[bench]')"
MemoryMeasure = Literal["live", "rss"]
MEMORY_MEASURES: tuple[MemoryMeasure, ...] = get_args(MemoryMeasure)
BACKENDS = ("nccl", "gloo")
TORCHRUN = "torchrun --nproc_per_node N -m commhooks bench"
# The cluster the default run also answers for: two machines of eight GPUs, the shape of most
# clusters whose machines are joined by a slow link.
STANDARD_SHAPE = Shape(2, 8)


@dataclass
class Plan:
    """Everything a bench run needs, validated.

    Attributes:
        bandwidths: the rate-limited links to measure on, in bit/s; ``[None]``: none (every
            hook always runs on loopback, which the predictions start from).
        links: the ladder of link rates to predict step times for, ascending.
        recommend_bps: the rates to recommend a hook for (``--link``, or the ladder).
        predict_bps: the rate given with ``--link``/``--predict``, if any.
        shapes: the cluster shapes predicted for, the first one in the ladder and the
            recommendations of old (``--nnodes``/``--nproc-per-node``, ``--world-size`` as
            machines of one rank; by default the ranks run, and two machines of eight).
        intra_link_bps: the rate between two ranks of one machine (``--intra-link``);
            ``None``: free.
        shape: the machines the ranks run as (``ranks`` is its size): on rate-limited links a
            namespace per machine; under a launcher, the launcher's.
        steps, reach_steps: the steps of allreduce and the measuring hooks, and of the others
            (which may take longer to reach allreduce's loss).
        memory: ``live``: each hook's peak memory from a run of its own with glibc mapping every
            large allocation afresh (``bench.footprint``); ``rss``: from the timed runs.
        model: the user's model factory (``--model package.module:factory``), if any.
        world: the launcher's world when the bench runs under one (torchrun): it joins it
            instead of starting ranks, and ``ranks`` is its size.
        backend: the process groups' backend (``nccl`` on GPUs, ``gloo`` on CPUs).
    """

    hooks: list[str]
    skipped: list[str]
    bandwidths: list[int | None]
    latency_s: float
    ranks: int
    steps: int
    warmup: int
    reach_steps: int
    task: str
    params: int
    lr: float
    seed: int
    bucket_cap_mb: float
    timeout_s: float
    json_path: str | None
    plot_path: str | None
    links: list[int] = field(default_factory=list)
    recommend_bps: list[int] = field(default_factory=list)
    predict_bps: int | None = None
    shapes: list[Shape] = field(default_factory=lambda: [Shape(2)])
    intra_link_bps: int | None = None
    shape: Shape = Shape(2)
    sweep: bool = False
    repeat: int = 1
    lockstep: bool = False
    memory: MemoryMeasure = "live"
    offload: bool = True
    fsdp: bool = False
    wide: bool = False
    notes: list[str] = field(default_factory=list)
    model: str | None = None
    world: LauncherWorld | None = None
    backend: str = "gloo"

    @property
    def predict_world(self) -> int:
        """The ranks of the first shape predicted for (``--world-size``, of old)."""
        return self.shapes[0].ranks

    @property
    def networks(self) -> list[int | None]:
        """Every network run: loopback first, then each link measured."""
        return [None, *(b for b in self.bandwidths if b is not None)]


def _version() -> str:
    import commhooks

    return f"commhooks {commhooks.__version__}"


def build_parser(prog: str = "commhooks bench") -> argparse.ArgumentParser:
    """The bench's flags (``commhooks bench --help``)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train a small model on local ranks with each hook, measure step time, "
        "bytes, memory and held-out loss, and predict from that which hook pays on which "
        "network link; optionally measure on rate-limited links too. Under torchrun "
        "(torchrun --nproc_per_node N -m commhooks bench) it joins the launcher's ranks "
        "instead and measures your own network and devices.",
    )
    p.add_argument("--version", action="version", version=_version())
    _hook_flags(p)
    _network_flags(p)
    _prediction_flags(p)
    _budget_flags(p)
    _output_flags(p)
    return p


def _hook_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hooks",
        help="comma-separated hook names (default: "
        f"{','.join(hookset.DEFAULT_HOOKS)}); torch_* names run PyTorch's hooks, floor_sync, "
        "floor_wire and floor_memory what any PowerSGD design pays (see docs/choosing-a-hook.md)",
    )
    p.add_argument(
        "--compare-torch",
        action="store_true",
        help="add PyTorch's own hooks (torch_fp16, torch_power_sgd, ...) as baselines",
    )
    p.add_argument(
        "--task",
        choices=TASKS,
        default=None,
        help="stdlib-lm (default: char transformer on Python's sources) or synthetic",
    )
    p.add_argument(
        "--model",
        metavar="PKG.MOD:FACTORY",
        help="train your own model instead of --task: a callable that returns "
        "commhooks.bench.usermodel.BenchModel(model, make_batch, loss) or a (model, batch) "
        "pair (see that module)",
    )
    p.add_argument("--params", default=None, help="synthetic task size (default 6M parameters)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=25.0,
        help="DDP bucket size for our hooks (default 25, DDP's)",
    )


def _network_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bandwidth",
        help=f"also measure on a link of this rate ({RATE_FORM}), to check the prediction; "
        "needs root",
    )
    p.add_argument(
        "--sweep", help="also measure on links of each rate, e.g. 50mbit,1gbit; needs root"
    )
    p.add_argument("--latency", help="one-way delay between ranks on the links, e.g. 5ms (netem)")
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
    p.add_argument("--ranks", type=int, default=None, help="local ranks to start (default 2)")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="under a launcher (torchrun): the process groups' backend (default nccl where "
        "there are GPUs, gloo otherwise); the local ranks started without one use gloo",
    )


def _prediction_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--links",
        help=f"link rates to predict each hook's step time for (default {DEFAULT_LADDER})",
    )
    p.add_argument(
        "--link",
        help="your link's rate: recommend a hook for it (default: for every rate of --links)",
    )
    p.add_argument("--predict", help="the same as --link")
    p.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="predict for this many machines (torchrun's --nnodes), each with one link of the "
        "rate predicted for; with --bandwidth, also run them as network namespaces",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks in each machine (torchrun's --nproc-per-node; default 1): what they send "
        "one another does not cross the link",
    )
    p.add_argument(
        "--intra-link",
        metavar="RATE",
        help="the rate between two ranks of one machine (NVLink, PCIe), which the prediction "
        "then charges too (default: free)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="the number of ranks to predict for, each a machine of its own (the prediction "
        "of --nnodes N --nproc-per-node 1, but only a prediction: with --bandwidth the links "
        "still run --ranks; default: the ranks run, and 2 machines of 8 ranks)",
    )


def _budget_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--steps",
        type=int,
        default=40,
        help="training steps of allreduce, the reference, and of the measuring hooks; every "
        "hook's held-out loss is taken after this many (default 40)",
    )
    p.add_argument(
        "--reach-steps",
        type=int,
        default=None,
        help="steps the other hooks may take to reach allreduce's final training loss, the "
        f"time to accuracy (default {REACH_FACTOR:g} x --steps)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="first steps left out of the timing (default: 5, or half of --steps if fewer)",
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
        "--memory",
        choices=MEMORY_MEASURES,
        default=None,
        help="how peak memory is measured. live (the default where the C library is glibc): "
        "one more run of each hook, with every allocation of 64 KiB or more mapped on its own "
        "and unmapped on free, so that the peak is what the steps hold live and repeats to a "
        "fraction of a MiB. rss: the timed runs' peak resident set, which also counts what the "
        "allocator kept after frees (it moves by about 5%% run to run); no extra run",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per hook run")


def _output_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wide", action="store_true", help="show every column of the results table")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write every figure as JSON")
    p.add_argument(
        "--plot",
        dest="plot_path",
        metavar="PATH",
        help="write a PNG: speedup over allreduce against link rate, held-out loss (matplotlib)",
    )


def parse(argv: list[str] | None = None) -> Plan:
    """Parse and validate ``argv``; exit with status 2 and a clear message on any bad flag."""
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return _plan(a)
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2 and the usage line


def _plan(a: argparse.Namespace) -> Plan:
    launched = launcher_world()
    hooks, skipped = _hooks(a)
    bandwidths, latency = _links_measured(a)
    links, recommend, predict_bps = _ladder(a)
    shape = _shape_run(a, launched, linked=bandwidths != [None])
    shapes = _shapes(a, shape)
    steps, warmup = _budget(a)
    _check_outputs(a)
    _check_model(a)
    notes = _fsdp_notes(a) + _add_references(
        hooks, sweep=bool(a.sweep), predict=_prediction_asked(a), other_world=shapes != [shape]
    )
    memory = _memory(a, notes) if launched is None else _launched_memory(a, launched, notes)
    return Plan(
        hooks=hooks,
        skipped=skipped,
        bandwidths=bandwidths,
        latency_s=latency,
        ranks=shape.ranks,
        steps=steps,
        warmup=warmup,
        reach_steps=_reach_steps(a, steps),
        task=a.task or "stdlib-lm",
        params=parse_params(a.params or "6M"),
        lr=_lr(a),
        seed=a.seed,
        bucket_cap_mb=a.bucket_cap_mb,
        timeout_s=a.timeout,
        json_path=a.json_path,
        plot_path=a.plot_path,
        links=links,
        recommend_bps=recommend,
        predict_bps=predict_bps,
        shapes=shapes,
        intra_link_bps=_rate(a.intra_link, "--intra-link"),
        shape=shape,
        sweep=bool(a.sweep),
        repeat=a.repeat,
        lockstep=a.lockstep,
        memory=memory,
        offload=a.offload,
        fsdp=a.fsdp,
        wide=a.wide,
        notes=notes,
        model=a.model,
        world=launched,
        backend=_backend(a, launched),
    )


def _hooks(a: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The hooks to run, and the default ones this build lacks."""
    available = hookset.available_hooks()
    valid = available + list(hookset.TORCH_HOOKS) + list(hookset.FLOOR_HOOKS)
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
            named = [
                h + (f" ({hint.strip()})" if (hint := suggest(h, valid)) else "") for h in unknown
            ]
            raise ValueError(
                f"unknown hook(s) {', '.join(named)}; valid hooks: {', '.join(valid)}."
            )
        hooks, skipped = list(requested), []
    if a.fsdp:
        if a.compare_torch:
            raise ValueError("--compare-torch runs PyTorch's DDP hooks, which FSDP2 has none of.")
        hooks = _for_fsdp(hooks, explicit=a.hooks is not None)
    if a.compare_torch:
        hooks += hookset.torch_counterparts(requested)
    if not hooks:
        raise ValueError(f"no hook to run; valid hooks: {', '.join(valid)}.")
    return hooks, skipped


def _for_fsdp(hooks: list[str], explicit: bool) -> list[str]:
    """The hooks to run under ``--fsdp``: those ``commhooks.fsdp.register`` takes.

    Hooks of the default list that it does not take are left out (:func:`_fsdp_notes` says
    so); hooks asked for by name are refused, naming the ones it takes.
    """
    from commhooks import fsdp

    valid = fsdp.hook_names()
    refused = [h for h in hooks if h not in valid]
    if refused and explicit:
        raise ValueError(
            f"--fsdp runs hooks through commhooks.fsdp.register, which does not take "
            f"{', '.join(refused)}; hooks for FSDP2: {', '.join(valid)}."
        )
    return [h for h in hooks if h in valid]


def _fsdp_notes(a: argparse.Namespace) -> list[str]:
    """Why hooks of the default list are missing from an ``--fsdp`` run."""
    from commhooks import fsdp

    if not a.fsdp or a.hooks is not None:
        return []
    valid = fsdp.hook_names()
    left_out = [h for h in hookset.DEFAULT_HOOKS if h not in valid]
    return [f"hook '{h}' does not apply to FSDP2 gradient shards; skipped" for h in left_out]


def _rates(text: str, flag: str) -> list[int]:
    items = [t for t in (s.strip() for s in text.split(",")) if t]
    if not items:
        raise ValueError(f"{flag} needs at least one rate: use {RATE_FORM}.")
    try:
        return [parse_rate(t) for t in items]
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from exc


def _rate(text: str | None, flag: str) -> int | None:
    """The one rate of ``flag``, or ``None`` where it was not given (an empty one is refused)."""
    if text is None:
        return None
    rates = _rates(text, flag)
    if len(rates) > 1:
        raise ValueError(f"{flag} takes one rate, got {len(rates)}.")
    return rates[0]


def _links_measured(a: argparse.Namespace) -> tuple[list[int | None], float]:
    """The rate-limited links to measure on (``[None]``: none), and their latency."""
    if a.bandwidth is not None and a.sweep is not None:
        raise ValueError("give --bandwidth or --sweep, not both (a sweep lists every rate).")
    bandwidths: list[int | None] = [None]
    if a.bandwidth is not None:
        bandwidths = list(_rates(a.bandwidth, "--bandwidth"))
        if len(bandwidths) > 1:
            raise ValueError("--bandwidth takes one rate; use --sweep for several.")
    if a.sweep is not None:
        bandwidths = list(sorted(set(_rates(a.sweep, "--sweep"))))
    latency = parse_duration(a.latency) if a.latency is not None else 0.0
    if latency and bandwidths == [None]:
        raise ValueError("--latency needs --bandwidth or --sweep (loopback has no link to delay).")
    if not a.offload and bandwidths == [None]:
        raise ValueError(
            "--no-offload needs --bandwidth or --sweep (loopback has no link to offload)."
        )
    if latency > 1.0:
        raise ValueError("--latency above 1s is not a network worth benchmarking; use e.g. 5ms.")
    return bandwidths, latency


def _ladder(a: argparse.Namespace) -> tuple[list[int], list[int], int | None]:
    """The rates to predict for, the rates to recommend for, and the user's own link."""
    if a.link is not None and a.predict is not None:
        raise ValueError("give --link or --predict (its older name), not both.")
    links = _rates(a.links if a.links is not None else DEFAULT_LADDER, "--links")
    own = _rate(a.link, "--link") if a.predict is None else _rate(a.predict, "--predict")
    ladder = sorted(set(links) | ({own} if own else set()))
    return ladder, [own] if own else ladder, own


def _shape_run(a: argparse.Namespace, launched: LauncherWorld | None, linked: bool) -> Shape:
    """The machines the ranks run as: the launcher's; on rate-limited links, the shape of
    ``--nnodes``/``--nproc-per-node`` (a namespace per machine); otherwise ``--ranks``
    (default 2) machines of one rank, as with ``--world-size``, which only predicts."""
    if launched is not None:
        _check_launched(a)  # first: a flag that does not apply there is named as such
    for flag, value in (("--world-size", a.world_size), ("--ranks", a.ranks)):
        if value is not None and value < 2:
            raise ValueError(f"{flag} must be at least 2 (a single rank communicates nothing).")
    asked = _shape_asked(a)
    if a.world_size is not None:
        asked = None  # machines of one rank to predict for, from the ranks run
    if launched is not None:
        if launched.world_size < 2:
            raise ValueError(
                "the launcher started a single process, which communicates nothing: start at "
                "least 2 (torchrun --nproc_per_node 2, or --nnodes 2)."
            )
        return launched.shape
    if linked and asked is not None:
        if a.ranks is not None:
            raise ValueError(
                "give --ranks or --nnodes/--nproc-per-node with --bandwidth or --sweep, not "
                f"both: the links run {asked.text()}, {asked.ranks} ranks."
            )
        _check_local(asked.ranks, "--nnodes x --nproc-per-node")
        return asked
    ranks = a.ranks or 2
    _check_local(ranks, "--ranks")
    return Shape.of_ranks(ranks)


def _check_local(ranks: int, flag: str) -> None:
    if ranks > MAX_LOCAL_RANKS:
        raise ValueError(
            f"{flag}: {ranks} ranks on one machine would measure the CPU, not the network; start "
            f"at most {MAX_LOCAL_RANKS} and predict larger clusters with --nnodes N "
            "--nproc-per-node G without --bandwidth (and --link RATE for your link)."
        )


def _shape_asked(a: argparse.Namespace) -> Shape | None:
    """The shape of ``--nnodes``/``--nproc-per-node`` (torchrun's defaults, 1, for the one not
    given), or of ``--world-size`` (machines of one rank); ``None`` when neither is given."""
    given = a.nnodes is not None or a.nproc_per_node is not None
    if given and a.world_size is not None:
        raise ValueError(
            "give --world-size or --nnodes/--nproc-per-node, not both: --world-size W is "
            "--nnodes W --nproc-per-node 1 (W machines of one rank)."
        )
    if a.world_size is not None:
        return Shape.of_ranks(a.world_size)
    if not given:
        return None
    for flag, value in (("--nnodes", a.nnodes), ("--nproc-per-node", a.nproc_per_node)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1.")
    shape = Shape(a.nnodes or 1, a.nproc_per_node or 1)
    if shape.ranks < 2:
        raise ValueError(
            "--nnodes x --nproc-per-node must make at least 2 ranks (a single rank "
            "communicates nothing)."
        )
    return shape


def _shapes(a: argparse.Namespace, run: Shape) -> list[Shape]:
    """The shapes to predict for: the one asked for, or the ranks run and two machines of
    eight GPUs."""
    asked = _shape_asked(a)
    if asked is not None:
        return [asked]
    return list(dict.fromkeys([run, STANDARD_SHAPE]))


def _check_launched(a: argparse.Namespace) -> None:
    """Refuse what has no meaning when the launcher made the ranks and the network is real."""
    refused = [
        ("--ranks", a.ranks is not None, "the launcher decides the ranks (--nproc_per_node)"),
        ("--bandwidth", a.bandwidth is not None, "the network measured is your own"),
        ("--sweep", a.sweep is not None, "the network measured is your own"),
        ("--latency", a.latency is not None, "the network measured is your own"),
        ("--no-offload", not a.offload, "the network measured is your own"),
        ("--fsdp", a.fsdp, "--fsdp runs on the local ranks the bench starts itself"),
    ]
    for flag, given, why in refused:
        if given:
            raise ValueError(f"{flag} does not apply under a launcher ({why}): drop it.")


def _backend(a: argparse.Namespace, launched: LauncherWorld | None) -> str:
    """NCCL on GPUs and gloo on CPUs under a launcher, unless told; gloo on local ranks."""
    import torch

    if launched is None:
        if a.backend == "nccl":
            raise ValueError(
                "the local ranks the bench starts run on the CPU over gloo; for NCCL on GPUs "
                f"run it under a launcher: {TORCHRUN} --backend nccl."
            )
        return "gloo"
    if a.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("--backend nccl needs GPUs, and this machine has none: drop --backend.")
    if a.backend:
        return str(a.backend)
    return "nccl" if torch.cuda.is_available() else "gloo"


def _check_model(a: argparse.Namespace) -> None:
    """``--model`` is of the form ``package.module:factory``; it replaces ``--task`` and
    ``--params``. Whether the factory imports and trains is checked once the run starts
    (:func:`commhooks.bench.usermodel.check_factory`), where every error is one line."""
    if a.model is None:
        if a.params is not None and a.task != "synthetic":
            raise ValueError(
                "--params sizes the synthetic task's model; add --task synthetic, or drop "
                "--params for the default task."
            )
        return
    for flag, value in (("--task", a.task), ("--params", a.params)):
        if value is not None:
            raise ValueError(
                f"give --model or {flag}, not both: with --model the factory decides what is "
                "trained."
            )
    from commhooks.bench.usermodel import split_name

    split_name(a.model)  # raises BenchModelError (a ValueError) with the fix


def _prediction_asked(a: argparse.Namespace) -> bool:
    """Whether a prediction was asked for, for a link or a cluster."""
    given = (a.links, a.link, a.predict, a.world_size, a.nnodes, a.nproc_per_node)
    return any(x is not None for x in given)


def _launched_memory(
    a: argparse.Namespace, launched: LauncherWorld, notes: list[str]
) -> MemoryMeasure:
    """Under a launcher every hook runs in the same process: only the resident-set peak,
    started afresh per hook, can be measured there. Also notes a shape the launcher did not
    say."""
    if launched.shape_note:
        notes.append(launched.shape_note)
    if a.memory == "live":
        raise ValueError(
            "--memory live needs a fresh process per hook, which the bench starts only without "
            "a launcher: drop --memory (under torchrun the peak resident set is measured per "
            "hook, and on GPUs the device's peak allocated memory)."
        )
    notes.append(
        "peak memory: each hook's peak resident set in the launcher's process, started afresh "
        "before it (and on GPUs the device's peak allocated memory)"
    )
    return "rss"


def _budget(a: argparse.Namespace) -> tuple[int, int]:
    """Steps and untimed steps per hook; also checks the other numbers of the run."""
    if a.steps < 1:
        raise ValueError("--steps must be at least 1.")
    warmup = min(5, a.steps // 2) if a.warmup is None else a.warmup
    if not 0 <= warmup < a.steps:
        raise ValueError(
            f"--warmup {warmup} must be between 0 and --steps - 1 ({a.steps - 1}): at least one "
            "step has to be timed."
        )
    if not 0 < a.bucket_cap_mb < math.inf:
        raise ValueError("--bucket-cap-mb must be a positive number.")
    if not 0 < a.timeout < math.inf:
        raise ValueError("--timeout must be a positive number of seconds.")
    if not 1 <= a.repeat <= 100:
        raise ValueError("--repeat must be between 1 and 100.")
    return a.steps, warmup


def _memory(a: argparse.Namespace, notes: list[str]) -> MemoryMeasure:
    """The memory measure asked for, or the default this machine allows (with a note)."""
    if footprint.can_map_afresh():
        return "rss" if a.memory == "rss" else "live"
    if a.memory == "live":
        raise ValueError(
            "--memory live needs glibc's allocator (Linux), which this Python does not use: "
            "run with --memory rss."
        )
    if a.memory is None:
        notes.append("peak memory from the timed runs (--memory rss): the C library is not glibc")
    return "rss"


def _reach_steps(a: argparse.Namespace, steps: int) -> int:
    reach: int = round(REACH_FACTOR * steps) if a.reach_steps is None else a.reach_steps
    if reach < steps:
        raise ValueError(
            f"--reach-steps {reach} is below --steps {steps}: the hooks compared with "
            "allreduce train at least as long as it does."
        )
    return reach


def _lr(a: argparse.Namespace) -> float:
    builtin = a.model is None and a.task in (None, "stdlib-lm")
    lr: float = a.lr if a.lr is not None else (3e-3 if builtin else 1e-3)
    if not 0 < lr < math.inf:
        raise ValueError("--lr must be a positive number.")
    return lr


def _check_outputs(a: argparse.Namespace) -> None:
    for flag, path in (("--json", a.json_path), ("--plot", a.plot_path)):
        if path:
            _check_writable(flag, path)
    if a.plot_path and not a.plot_path.lower().endswith(".png"):
        raise ValueError(f"--plot {a.plot_path!r}: give a .png path.")
    if a.plot_path and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            f"--plot draws with matplotlib, and matplotlib is not installed: {PLOT_INSTALL}."
        )


def _check_writable(flag: str, path: str) -> None:
    """Refuse an output file that could not be written, now rather than after the whole run.

    A file is made beside it and removed again (the JSON is written beside its target and
    renamed into place; the plot straight there), and a file that exists already is opened to
    append nothing: what a directory's permissions, a read-only or virtual file system
    (``/proc``) or a full disk refuses is refused here, and nothing is left behind.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path!r}: its directory does not exist.")
    if os.path.isdir(path):
        raise ValueError(
            f"{flag} {path!r} is a directory: give a file in it, e.g. "
            f"{os.path.join(path, 'bench.json' if flag == '--json' else 'bench.png')!r}."
        )
    try:
        handle, probe = tempfile.mkstemp(prefix=".commhooks-bench-", dir=folder)
        os.close(handle)
        os.remove(probe)
        if os.path.exists(path):
            with open(path, "a"):
                pass
    except OSError as exc:
        raise ValueError(
            f"{flag} {path!r}: it cannot be written ({exc.strerror or exc}); give a path in "
            "a directory you can write to."
        ) from None


def _add_references(hooks: list[str], sweep: bool, predict: bool, other_world: bool) -> list[str]:
    """Add, in place, the hooks a sweep or an asked-for prediction is computed against.

    A sweep and a prediction report each hook's speedup over ``allreduce``; the predictions for
    another shape than the one run (2 machines of 8 ranks, always) need ``noop``, to tell the
    backend's per-byte work from the rest.
    Returns one note per hook added, saying why.
    """
    notes = []
    for needed, wanted, why in (
        ("noop", other_world, "predictions for another shape need it"),
        ("allreduce", sweep or predict, "speedups are over it"),
    ):
        if wanted and needed not in hooks:
            hooks.insert(0 if needed == "noop" else min(1, len(hooks)), needed)
            notes.append(f"added hook '{needed}': {why}")
    return notes
