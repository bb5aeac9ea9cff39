"""Which hooks the bench can run, with which settings, and how each one is attached.

Our hooks are attached through :func:`commhooks.register`, so every hook registered in
``commhooks.config`` is benchmarkable without touching this module. PyTorch's own hooks are the
``torch_*`` baselines; they are imported here lazily, only when asked for, and a failure to
register or run them is reported as a result rather than raised.
"""

import importlib
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "DEFAULT_HOOKS",
    "HOOK_SETTINGS",
    "FLOOR_HOOKS",
    "MEASURING_HOOKS",
    "TORCH_HOOKS",
    "SINGLE_BUCKET_MB",
    "attach",
    "available_hooks",
    "calls_torch_directly",
    "recommendable",
    "torch_counterparts",
]

DEFAULT_HOOKS = (
    "noop",
    "allreduce",
    "fp16",
    "bf16",
    "power_sgd",
    "power_sgd_single_round",
    "post_local_sgd",
    "int8",
    "int4",
    "diloco",
    "streaming_diloco",
)

# Short warm-ups so that a budget of a few dozen steps is mostly spent in the regime measured.
POWERSGD_SETTINGS: dict[str, Any] = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 3}
# Each local rank stands for a machine of its own: after the warm-up no gradient allreduce at
# all (the default subgroup, one per machine, would be the whole world here), only the
# periodic parameter averaging.
LOCALSGD_SETTINGS: dict[str, Any] = {
    "start_localSGD_iter": 3,
    "post_local_gradient_allreduce": False,
}
AVERAGER_PERIOD = 4
# Each local rank is a DiLoCo worker of its own. The same three warm-up steps of global
# gradient averaging as post-local SGD; then DiLoCo syncs the model every 8 inner steps.
# diloco: whole, in float32, with the paper's outer Nesterov SGD (lr 0.7, momentum 0.9).
# streaming_diloco: in 4 fragments, one every 2 steps, each applied one inner step after it is
# issued (the overlap) with the step taken meanwhile kept, in int4, after a warm-up that
# averages gradients in int8 (in int4 the loss took 52 steps). Its outer SGD has no
# momentum and lr 1: a run this short gives each fragment about four outer steps, too few for
# momentum to pay. On the default task it reaches allreduce's 40-step loss in 43 steps; with
# the paper's outer SGD and weights blended half and half, 53; dropping the step taken in
# flight (as the paper does), 52; fewer warm-up steps, 52 (docs/benchmarks.md, "Streaming
# DiLoCo", has the whole sweep).
DILOCO_SETTINGS: dict[str, Any] = {"sync_every": 8, "warmup_steps": 3}
STREAMING_DILOCO_SETTINGS: dict[str, Any] = {
    **DILOCO_SETTINGS,
    "fragments": 4,
    "fragment_sync_delay": 1,
    "keep_inflight_steps": True,
    "bits": 4,
    "warmup_bits": 8,
    "outer_lr": 1.0,
    "outer_momentum": 0.0,
}

HOOK_SETTINGS: dict[str, dict[str, Any]] = {
    "power_sgd": POWERSGD_SETTINGS,
    "batched_power_sgd": POWERSGD_SETTINGS,
    "power_sgd_single_round": POWERSGD_SETTINGS,
    "post_local_sgd": LOCALSGD_SETTINGS,
    "diloco": DILOCO_SETTINGS,
    "streaming_diloco": STREAMING_DILOCO_SETTINGS,
    "torch_power_sgd": POWERSGD_SETTINGS,
    "torch_batched_power_sgd": POWERSGD_SETTINGS,
    "torch_post_local_sgd": LOCALSGD_SETTINGS,
}

TORCH_HOOKS = (
    "torch_noop",
    "torch_allreduce",
    "torch_fp16",
    "torch_bf16",
    "torch_power_sgd",
    "torch_batched_power_sgd",
    "torch_post_local_sgd",
    "torch_quantize_per_tensor",
    "torch_quantize_per_channel",
)
# Reference floors (see ``commhooks.bench.baselines.floors``): the cost of communicating at all, of
# sending single-round PowerSGD's bytes, and of error feedback's memory passes, without any
# compression work. They imitate PowerSGD at the rank it is benchmarked with.
FLOOR_HOOKS = ("floor_sync", "floor_wire", "floor_memory")
for _name in FLOOR_HOOKS:
    HOOK_SETTINGS[_name] = POWERSGD_SETTINGS
# Hooks that measure rather than train: never a recommendation.
MEASURING_HOOKS = ("noop", "torch_noop", *FLOOR_HOOKS)
# PyTorch's PowerSGD issues follow-up collectives from future callbacks and aborts on gloo when
# a model has several buckets; one bucket holding every gradient lets the baseline complete.
SINGLE_BUCKET_MB = 4096.0
SINGLE_BUCKET_HOOKS = ("torch_power_sgd", "torch_batched_power_sgd")

_COUNTERPARTS = {
    "noop": ("torch_noop",),
    "allreduce": ("torch_allreduce",),
    "fp16": ("torch_fp16",),
    "bf16": ("torch_bf16",),
    "power_sgd": ("torch_power_sgd", "torch_batched_power_sgd"),
    "power_sgd_single_round": ("torch_power_sgd",),
    "batched_power_sgd": ("torch_batched_power_sgd",),
    "post_local_sgd": ("torch_post_local_sgd",),
    "int8": ("torch_quantize_per_tensor", "torch_quantize_per_channel"),
    "int4": ("torch_quantize_per_tensor", "torch_quantize_per_channel"),
}


def available_hooks() -> list[str]:
    """Names of our hooks registered in this build, and ``no``: DDP's own allreduce, no hook."""
    from commhooks import config

    return config.hook_names()


def calls_torch_directly(name: str) -> bool:
    """Whether hook ``name`` issues collectives through ``torch.distributed`` itself (PyTorch's
    hooks), rather than through ``commhooks.comm``, where they are counted anyway."""
    return name.startswith("torch_")


def recommendable(name: str) -> bool:
    """Whether hook ``name`` is one to train with: not a measuring instrument, not a baseline.

    These are the hooks the bench recommends from, and the ones that train past ``--steps``,
    up to ``--reach-steps``, to show when they reach ``allreduce``'s loss.
    """
    return name not in MEASURING_HOOKS and not calls_torch_directly(name)


def torch_counterparts(names: Iterable[str]) -> list[str]:
    """PyTorch's hooks that correspond to ``names`` (for ``--compare-torch``)."""
    out: list[str] = []
    for name in names:
        for twin in _COUNTERPARTS.get(name, ()):
            if twin not in out and twin not in names:
                out.append(twin)
    return out


def settings_for(name: str) -> dict[str, Any]:
    """The state options the bench passes to ``name``, limited to those its spec accepts."""
    wanted = dict(HOOK_SETTINGS.get(name, {}))
    if name.startswith(("torch_", "floor_")) or not wanted:
        return wanted
    from commhooks import config

    accepted = config.hook_spec(name).options
    return {k: v for k, v in wanted.items() if k in accepted}


def attach(ddp: Any, name: str, options: dict[str, Any]) -> Callable[[], Any]:
    """Register hook ``name`` on ``ddp``; return a callable run after each optimizer step.

    The callable is the model averager for post-local SGD (when the build has one), a no-op
    otherwise.
    """
    if name.startswith("torch_"):
        return _attach_torch(ddp, name, options)
    if name in FLOOR_HOOKS:
        _baselines("commhooks.bench.baselines.floors").attach_floor(ddp, name, options)
        return lambda: None
    import commhooks

    state = commhooks.register(ddp, name, **options)
    if name == "post_local_sgd" and hasattr(commhooks, "PeriodicModelAverager"):
        warmup = options.get("start_localSGD_iter", 0)
        averager = commhooks.PeriodicModelAverager(
            period=AVERAGER_PERIOD, warmup_steps=warmup, process_group=ddp.process_group
        )
        return lambda: averager.average_parameters(ddp.module.parameters())
    if isinstance(state, getattr(commhooks, "ModelAverager", ())):
        return _AveragerAfterStep(ddp, state)
    return lambda: None


class _AveragerAfterStep:
    """The after-step call of a hook whose state is a model averager (DiLoCo's): it starts
    from the parameters DDP made equal on every rank, unless a warm-up does that; ``finish``
    (after the last step) completes a sync still in flight."""

    def __init__(self, ddp: Any, averager: Any) -> None:
        self.named = list(ddp.module.named_parameters())
        self.averager = averager
        if averager.warmup_steps == 0:
            averager.start(self.named)

    def __call__(self) -> None:
        self.averager.average_named([(n, p) for n, p in self.named if p.grad is not None])

    def finish(self) -> None:
        self.averager.finish()


def _attach_torch(ddp: Any, name: str, options: dict[str, Any]) -> Callable[[], Any]:
    attach_torch = _baselines("commhooks.bench.baselines").attach_torch
    after_step: Callable[[], Any] = attach_torch(
        ddp, name, options, averager_period=AVERAGER_PERIOD
    )
    return after_step


def _baselines(module: str) -> Any:
    """A module of ``commhooks.bench.baselines`` (it imports PyTorch's own hooks, which the
    library never does); loaded only when a baseline or floor is asked for."""
    return importlib.import_module(module)
