"""Checkpointing hook state whose content differs between ranks.

Some hook state is each rank's own (error feedback: what compression has not sent yet of this
rank's gradient). Frameworks that write one file from rank 0 (Accelerate's ``save_state``,
Lightning) keep rank 0's copy only, and ``torch.distributed.checkpoint`` one copy of each key:
either way the other ranks would resume with rank 0's error and drift.

* :class:`PerRankState` gathers every rank's ``state_dict()`` on rank 0 for single-file
  savers, and gives each rank its own entry back on load.
* :class:`DistributedCheckpointState` stores each rank's ``state_dict()`` under its own key
  for ``torch.distributed.checkpoint``, in a form that loads without a template of the same
  shapes (a fresh state has not allocated its buffers yet).
"""

import io
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks._warnings import warn_once
from commhooks.state import HookState, StateDictError

__all__ = ["DistributedCheckpointState", "PerRankState"]


class PerRankState(HookState):
    """Every rank's hook state in one checkpoint written by rank 0.

    ``state_dict()`` is a collective (Accelerate's ``save_state`` and Lightning's
    ``save_checkpoint`` call it on every rank): rank 0 gets every rank's entry, the others the
    header only, refused on load. ``load_state_dict`` hands each rank its own entry. The file
    loads with ``torch.load(path, weights_only=True)``.

    Args:
        state: the hook state returned by ``commhooks.register``.
        process_group: the group the hook communicates on (``None``: the default group).
        allow_resize: where another number of ranks wrote the checkpoint, every rank loads
            rank 0's entry (the state's checks decide what still fits) instead of raising.

    Example::

        state = commhooks.register(ddp_model, "power_sgd", start_powerSGD_iter=10)
        accelerator.register_for_checkpointing(PerRankState(state))
    """

    kind = "per_rank"

    def __init__(
        self,
        state: Any,
        process_group: dist.ProcessGroup | None = None,
        allow_resize: bool = False,
    ) -> None:
        _check_stateful(state, "PerRankState")
        super().__init__(process_group)
        self.state, self.allow_resize = state, allow_resize

    def _save(self) -> dict[str, Any]:
        group = self.process_group
        entries = comm.gather_objects(self.state.state_dict(), group)
        return {"world_size": comm.world_size(group), "ranks": entries or []}

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        entries, saved = state_dict.get("ranks"), state_dict.get("world_size")
        if not isinstance(entries, list) or not isinstance(saved, int) or len(entries) != saved:
            raise StateDictError(
                "PerRankState.load_state_dict: the 'ranks' entries are missing or incomplete. "
                "Load the file written by rank 0 (the only rank that holds every entry)."
            )
        world, rank = comm.world_size(self.process_group), comm.group_rank(self.process_group)
        if saved != world:
            if not self.allow_resize:
                raise StateDictError(
                    f"PerRankState.load_state_dict: the checkpoint holds the hook state of "
                    f"{saved} ranks, and {world} are loading it. Resume with {saved} ranks, "
                    "construct PerRankState(..., allow_resize=True) to give every rank rank 0's "
                    "state, or skip loading the hook state to restart it."
                )
            warn_once(
                "per-rank-resize",
                f"hook state saved by {saved} ranks is loaded by {world}: every rank takes "
                "rank 0's entry.",
            )
            rank = 0
        self.state.load_state_dict(entries[rank])


class DistributedCheckpointState:
    """A ``torch.distributed.checkpoint`` ``Stateful`` for hook state, one entry per rank.

    ``dcp`` writes one copy of each key all ranks share and loads into a template of the same
    shapes, but hook state differs between ranks and a fresh one has no buffers yet: each
    rank's state dict is stored serialised, under a key of its own.

    Example::

        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict(), "hook": DistributedCheckpointState(state)}, ...)
        dcp.load({"model": model.state_dict(), "hook": DistributedCheckpointState(state)}, ...)
    """

    def __init__(self, state: Any) -> None:
        _check_stateful(state, "DistributedCheckpointState")
        self.state = state

    def _key(self) -> str:
        return f"rank{dist.get_rank()}"

    def state_dict(self) -> dict[str, Any]:
        """This rank's state under its global rank, serialised as bytes."""
        buf = io.BytesIO()
        torch.save(self.state.state_dict(), buf)
        return {self._key(): buf.getvalue()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore this rank's entry (read with ``weights_only=True``)."""
        blob = state_dict.get(self._key())
        if not isinstance(blob, (bytes, bytearray)):
            raise StateDictError(
                f"DistributedCheckpointState: the checkpoint has no hook state for "
                f"{self._key()}; it was written by fewer ranks or without this state."
            )
        self.state.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))


def _check_stateful(state: Any, owner: str) -> None:
    if state is None:
        raise TypeError(
            f"{owner} wraps a hook state, got None: no hook is registered on the model (in a "
            "single process Accelerate does not wrap it in DDP, so hook_state(model) is None; "
            "or the model is not prepared yet). Wrap the state once a hook is registered."
        )
    if not (callable(getattr(state, "state_dict", None)) and hasattr(state, "load_state_dict")):
        raise TypeError(
            f"{owner} wraps a hook state with state_dict()/load_state_dict(), got "
            f"{type(state).__name__}. Stateless hooks (allreduce, fp16...) need no checkpoint."
        )
