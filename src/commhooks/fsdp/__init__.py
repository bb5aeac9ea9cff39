"""FSDP2: compress the gradient traffic between machines of ``fully_shard`` training.

Shard the model with ``fully_shard`` over the ranks of one machine only, then let
:func:`register` average each FSDP module's gradient shard across machines with one of the
package's hooks. That is HSDP with the slow, cross-machine all-reduce compressed::

    mesh = init_device_mesh("cuda", (machines, gpus_per_machine),
                            mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = commhooks.fsdp.register(model, "power_sgd", mesh=mesh, matrix_approximation_rank=4)

The hooks and their states are the DDP ones, unchanged: PowerSGD compresses each parameter's
shard as a matrix, with its state kept per parameter, and the state checkpoints as under DDP.
"""

import contextlib
import weakref
from typing import Any

import torch.distributed as dist
from torch import nn

from commhooks import comm
from commhooks.config import CommHookType, HookConfig, hook_spec, parse_name
from commhooks.config import hook_names as _all_hook_names
from commhooks.fsdp.bucket import ShardHook, StepTracker, reduced_shards
from commhooks.fsdp.pending import PendingShards
from commhooks.place import MeshPlace, shard_place
from commhooks.state import HookState

__all__ = ["hook_names", "register"]

# Hooks of ``commhooks.register`` that have no meaning on a gradient shard, and what to do.
_NOT_FOR_SHARDS = {
    CommHookType.NO: "hook 'no' registers nothing. To let FSDP2 average across machines "
    "itself, shard the model on the whole 2-D mesh (native HSDP) and do not call "
    "commhooks.fsdp.register; otherwise choose a hook",
    CommHookType.BATCHED_POWER_SGD: "it compresses a whole DDP bucket as one square matrix. "
    "Use 'power_sgd', which compresses each parameter's shard as a matrix",
    CommHookType.POST_LOCAL_SGD: "it stops averaging across machines after a warm-up, and "
    "within a machine FSDP2's reduce-scatter already averages. Use 'noop' with a model "
    "averager, or another hook",
    **{
        kind: "DiLoCo averages parameters, not gradient shards, and its averager works on whole "
        "(not sharded) parameters. Use DDP within a machine and commhooks.register(ddp_model, "
        f"'{kind}', ...)"
        for kind in (CommHookType.DILOCO, CommHookType.STREAMING_DILOCO)
    },
}
_OWNER = "commhooks.fsdp.register"
_hooked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # FSDP modules with a hook of ours


def hook_names() -> list[str]:
    """Every hook name :func:`register` accepts in this installation."""
    refused = {str(kind) for kind in _NOT_FOR_SHARDS}
    return [name for name in _all_hook_names() if name not in refused]


def register(
    module: nn.Module,
    hook: CommHookType | str,
    *,
    mesh: Any = None,
    replicate_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> Any:
    """Average every FSDP module's gradient shard across machines with hook ``hook``.

    Call it on every rank, after ``fully_shard`` and before the first forward pass. Everything
    is checked, then compared across every rank of the mesh (two small gathers), so mistakes
    raise here, on every rank. Sets ``set_reduce_scatter_unused_params(True)`` on each module:
    a parameter without a gradient is reduced as zeros, as with DDP's
    ``find_unused_parameters``, so every rank hands the hook the same layout.

    Args:
        module: the root of a model sharded with ``fully_shard`` over the ranks of one machine
            (``mesh["shard"]``); the hook goes on every FSDP module under it.
        hook: a name of :func:`hook_names` (``"power_sgd"``...), in any case.
        mesh: a 2-D ``DeviceMesh`` with dimensions named ``"replicate"`` and ``"shard"``.
        replicate_group: instead of ``mesh``, the group of the ranks (one per machine) that hold
            the same shard.
        **options: the hook's options, as for :func:`commhooks.register`.

    Returns:
        the hook's state (keep it to checkpoint it), or for the hooks that keep none
        (``noop``) the replicate group itself.

    Raises:
        ValueError: an unknown or unfit hook or option, no FSDP module, not exactly one fitting
            ``mesh`` or ``replicate_group``, options that differ between ranks.
        TypeError: an argument of the wrong type.
    """
    kind = _hook_kind(hook)
    config = HookConfig(kind, None, _hook_options(options))
    named = _fsdp_modules(module)
    replicate, shard = _groups(mesh, replicate_group, _shard_mesh(named))
    spec = hook_spec(kind)
    state = spec.make_state(replicate, dict(config.options)) if spec.make_state else replicate
    if isinstance(state, HookState):
        state.set_mesh_place(_mesh_place(named, shard))
    comm.check_same_on_grid({"hook": str(kind), **config.options}, [shard, replicate], owner=_OWNER)
    _install(named, spec.hook, state, overlap=shard.size() == 1)
    _number_in_module_order(state, named)
    return state


def _number_in_module_order(state: Any, named: list[tuple[str, nn.Module]]) -> None:
    """Number the parameters the state keeps memories of now, module by module from the last
    (the order a backward pass reaches them in), rather than as modules first call the hook:
    one that sits out the first step after a resume, or joins later, would shift the numbers,
    and the loaded memories would meet other parameters."""
    number = getattr(state, "number", None)
    if callable(number):
        for _, module in reversed(named):
            number([slot.param for slot in reduced_shards(module)])


def _hook_kind(hook: Any) -> CommHookType:
    try:
        return parse_name(hook, "hook", tuple(CommHookType(n) for n in hook_names()))
    except ValueError:
        refused = None
        with contextlib.suppress(ValueError):
            refused = parse_name(hook, "hook")
        if refused is None:
            raise
    raise ValueError(
        f"hook '{refused}' does not apply to FSDP2 gradient shards: {_NOT_FOR_SHARDS[refused]}. "
        f"Hooks for FSDP2: {', '.join(hook_names())}."
    ) from None


def _hook_options(options: dict[str, Any]) -> dict[str, Any]:
    misplaced = {
        "process_group": "the hook communicates on the replicate group: pass mesh=... or "
        "replicate_group=...",
        "wrapper": "to average in reduced precision, use hook 'fp16' or 'bf16', or shard with "
        "MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) so that every hook gets a bfloat16 "
        "shard",
    }
    for name, fix in misplaced.items():
        if name in options:
            raise ValueError(f"{_OWNER} takes no '{name}': {fix}.")
    return options


def _fsdp_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FSDP modules under ``module`` that manage trainable parameters, with their names."""
    fsdp_module = _fsdp_module_class()
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_OWNER} expects the model (an nn.Module), got {type(module).__name__}.")
    found = [(name or "the root module", m) for name, m in module.named_modules()]
    found = [(name, m) for name, m in found if isinstance(m, fsdp_module)]
    if not found:
        raise ValueError(
            f"{_OWNER}: there is no FSDP module under the {type(module).__name__} given. Shard "
            'the model first, on the ranks of one machine: fully_shard(block, mesh=mesh["shard"]) '
            'for each block, then fully_shard(model, mesh=mesh["shard"]).'
        )
    if any(m in _hooked for _, m in found):
        raise ValueError(
            f"{_OWNER}: this model already has a commhooks hook, and FSDP2 takes one all-reduce "
            "hook per module. Register once, with the hook you want."
        )
    trainable = [(name, m) for name, m in found if reduced_shards(m)]
    if not trainable:
        raise ValueError(f"{_OWNER}: the model's FSDP modules have no parameter to train.")
    return trainable


def _fsdp_module_class() -> type:
    from torch.distributed.fsdp import FSDPModule

    for needed in ("set_all_reduce_hook", "set_reduce_scatter_unused_params"):
        if not hasattr(FSDPModule, needed):
            raise RuntimeError(
                f"{_OWNER} needs FSDPModule.{needed}, which this PyTorch lacks; use a PyTorch "
                "whose fully_shard has it (tested with 2.13)."
            )
    return FSDPModule


def _shard_mesh(named: list[tuple[str, nn.Module]]) -> Any:
    """The 1-D mesh the model is sharded on, checked to be the same for every module."""
    meshes: dict[tuple[int, ...], tuple[str, Any]] = {}
    for name, m in named:
        for slot in reduced_shards(m):
            mesh = slot.param.device_mesh  # type: ignore[attr-defined]  # a DTensor
            meshes.setdefault(_ranks_of(mesh), (name, mesh))
    if len(meshes) > 1:
        where = "; ".join(f"{name} on ranks {list(r)}" for r, (name, _) in meshes.items())
        raise ValueError(f"{_OWNER}: the FSDP modules are sharded on different meshes ({where}).")
    _, shard_mesh = next(iter(meshes.values()))
    if shard_mesh.ndim != 1:
        raise ValueError(
            f"{_OWNER}: the model is sharded on a {shard_mesh.ndim}-D mesh (native HSDP), so "
            'FSDP2 already averages across machines. Shard it on mesh["shard"] only, for the '
            "hook to average across machines instead."
        )
    return shard_mesh


def _groups(
    mesh: Any, replicate_group: dist.ProcessGroup | None, shard_mesh: Any
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(replicate group, shard group)``, checked against the model's shard mesh."""
    if (mesh is None) == (replicate_group is None):
        given = "both" if mesh is not None else "neither"
        raise ValueError(
            f"{_OWNER} needs exactly one of mesh and replicate_group, and was given {given}: "
            'pass mesh=init_device_mesh(device, (machines, ranks_per_machine), mesh_dim_names=("'
            'replicate", "shard")), or replicate_group=<the group of the ranks that hold the '
            "same shard>."
        )
    if mesh is not None:
        return _mesh_groups(mesh, shard_mesh)
    group = comm.resolve_group(replicate_group, owner=_OWNER)
    shard: dist.ProcessGroup = shard_mesh.get_group()
    shared = set(comm.global_ranks(group)) & set(comm.global_ranks(shard))
    if shared != {dist.get_rank()}:
        raise ValueError(
            f"{_OWNER}: replicate_group must hold one rank per machine, those that hold the "
            f"same shard; it shares ranks {sorted(shared)} with the model's shard group. Pass "
            'mesh=... instead, or the group of mesh["replicate"].'
        )
    return group, shard


def _mesh_groups(mesh: Any, shard_mesh: Any) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{_OWNER}: mesh must be a DeviceMesh, got {type(mesh).__name__}.")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or sorted(names) != ["replicate", "shard"]:
        raise ValueError(
            f"{_OWNER}: mesh must be 2-D with dimensions named 'replicate' and 'shard'; got a "
            f"{mesh.ndim}-D mesh with names {names or None}. Build it with init_device_mesh("
            'device, (machines, ranks_per_machine), mesh_dim_names=("replicate", "shard")).'
        )
    if _ranks_of(mesh["shard"]) != _ranks_of(shard_mesh):
        raise ValueError(
            f'{_OWNER}: the model is sharded on ranks {list(_ranks_of(shard_mesh))}, but mesh["'
            f'shard"] holds ranks {list(_ranks_of(mesh["shard"]))}. Shard the model with '
            'fully_shard(..., mesh=mesh["shard"]).'
        )
    return mesh.get_group("replicate"), mesh.get_group("shard")


def _ranks_of(mesh: Any) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def _mesh_place(named: list[tuple[str, nn.Module]], shard: dist.ProcessGroup) -> MeshPlace:
    """This rank's shard coordinate and layout (:mod:`commhooks.place`)."""
    shards = [
        (slot.param.shape, slot.shape) for _, module in named for slot in reduced_shards(module)
    ]
    return shard_place(comm.group_rank(shard), comm.world_size(shard), shards)


def _install(named: list[tuple[str, nn.Module]], hook: Any, state: Any, overlap: bool) -> None:
    """Put a ``ShardHook`` on every module; with ``overlap`` (one rank per machine, where the
    hook's collectives are the only ones in flight) results may land at the end of the pass.
    With several, FSDP2's next reduce-scatter would run on gloo while the hook's are in flight
    on another group: one run of the 2 x 2 tests saw gloo's loop thread segfault that way,
    not reproduced since; until it is understood, the hook waits there."""
    steps = StepTracker([name for name, _ in named])
    pending = PendingShards() if overlap else None
    for index, (_, m) in enumerate(named):
        steps.watch(m, index)
        m.set_reduce_scatter_unused_params(True, recurse=False)  # type: ignore[operator]
        shard_hook = ShardHook(m, index, hook, state, steps, pending)
        m.set_all_reduce_hook(shard_hook)  # type: ignore[operator]
        _hooked.add(m)
