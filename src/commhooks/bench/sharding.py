"""``commhooks bench --fsdp``: the task's model sharded with FSDP2, the hook across machines.

Each rank stands for a machine: the model is sharded with ``fully_shard`` over a shard group of
one rank (so FSDP2's reduce-scatter is a local copy), and :func:`commhooks.fsdp.register`
averages every FSDP module's gradient shard across the ranks with the hook under test. The
bytes on the link are therefore the hook's alone, as with DDP.
"""

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["attach_sharded"]

# Each of these becomes an FSDP module of its own (the usual per-layer wrapping); what is left
# (a transformer's positions and final norm) goes to the root module.
_UNITS = (nn.TransformerEncoderLayer, nn.Linear, nn.Embedding)


def attach_sharded(model: nn.Module, hook: str, options: dict[str, Any]) -> Callable[[], None]:
    """Shard ``model`` in place, one FSDP module per layer, and register ``hook`` on it.

    Call on every rank, after ``init_process_group``; a collective (the mesh, the option check).
    Returns what to run after each optimizer step, as ``hookset.attach`` does: nothing here.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import commhooks

    mesh = init_device_mesh(
        "cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard")
    )
    for unit in _layers(model):
        # A shard group of one saves no memory by resharding between forward and backward;
        # keeping the parameters saves FSDP2 the second all-gather (copies, here) of each step.
        fully_shard(unit, mesh=mesh["shard"], reshard_after_forward=False)
    fully_shard(model, mesh=mesh["shard"])
    commhooks.fsdp.register(model, hook, mesh=mesh, **options)
    return lambda: None


def _layers(module: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []
    for child in module.children():
        found.extend([child] if isinstance(child, _UNITS) else _layers(child))
    return found
