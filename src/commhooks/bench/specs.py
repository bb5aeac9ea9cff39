"""What each hook's run is made of, from the plan: its steps, its bucket size, the spec every
rank follows and the settings its row records. Shared by the local run (:mod:`.cli`) and the
run under a launcher (:mod:`.launched`)."""

import dataclasses
from typing import Any

from commhooks.bench import hookset
from commhooks.bench.args import Plan
from commhooks.bench.netns import Network
from commhooks.bench.records import RunSpec

__all__ = ["memory_spec", "row_context", "run_spec"]


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
        host_ends=net.rank_host_ends() if net is not None else None,
        fsdp=plan.fsdp,
        model=plan.model,
    )


def memory_spec(plan: Plan, hook: str, net: Network | None) -> RunSpec:
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
