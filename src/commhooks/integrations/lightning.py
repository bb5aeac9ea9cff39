"""A Lightning ``DDPStrategy`` that registers commhooks hooks on CPU as well as GPU.

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers the hook only when training on CUDA,
and its checkpoints do not include the hook's state. :class:`CommHookDDPStrategy` registers
through :func:`commhooks.register` on any device and saves every rank's hook state in the
checkpoint under ``"commhooks"``, restoring it when training resumes from that checkpoint::

    import lightning as L
    from commhooks.integrations.lightning import CommHookDDPStrategy

    strategy = CommHookDDPStrategy("power_sgd", hook_options={"matrix_approximation_rank": 2})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy)

Code written for ``DDPStrategy`` keeps its arguments: ``CommHookDDPStrategy(ddp_comm_state=...,
ddp_comm_hook=..., ddp_comm_wrapper=...)`` registers them as ``DDPStrategy`` would on CUDA, on
any device.

With ``"streaming_diloco"`` or ``"diloco"`` the strategy also attaches the averager the hook
registers to the optimizer, and applies a fragment still in flight when training ends.

Requires the optional extra: ``pip install "commhooks[lightning]"``.
"""

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from commhooks.averaging.averagers import ModelAverager
from commhooks.config import CommHookType, HookConfig, register_from_config
from commhooks.integrations.checkpoint import PerRankState
from commhooks.state import StatelessState

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "commhooks.integrations.lightning needs Lightning: pip install 'commhooks[lightning]'."
    ) from exc

__all__ = ["CHECKPOINT_KEY", "CommHookDDPStrategy"]

CHECKPOINT_KEY = "commhooks"


class CommHookDDPStrategy(DDPStrategy):
    """``DDPStrategy`` with a commhooks hook, registered on CPU and GPU, checkpointed.

    Args:
        hook: a hook name or ``CommHookType`` (``"fp16"``, ``"power_sgd"``...), or a
            :class:`~commhooks.config.HookConfig` (then ``wrapper`` and ``hook_options`` must
            be left out).
        wrapper: ``None``/``"no"``, ``"fp16"`` or ``"bf16"``.
        hook_options: the hook's state options, e.g. ``{"matrix_approximation_rank": 2}``.
            A separate mapping because the remaining keyword arguments go to DDP itself, as in
            ``DDPStrategy`` (``bucket_cap_mb``, ``find_unused_parameters``...).
        hook_process_group: the group the hook communicates on (``None``: DDP's group).
        **kwargs: passed to ``DDPStrategy``, except its ``ddp_comm_hook``, ``ddp_comm_state``
            and ``ddp_comm_wrapper``, which this strategy registers itself, on any device,
            instead of ``hook``/``wrapper``/``hook_options``.

    Raises:
        ValueError: an invalid hook choice, at construction, before any process starts.
    """

    def __init__(
        self,
        hook: CommHookType | str | HookConfig | None = None,
        wrapper: CommHookType | str | None = None,
        hook_options: Mapping[str, Any] | None = None,
        hook_process_group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        self._lightning_hook = _lightning_hook_args(
            kwargs, hook, wrapper, hook_options, hook_process_group
        )
        hook = CommHookType.ALLREDUCE if hook is None else hook
        if isinstance(hook, HookConfig):
            if wrapper is not None or hook_options:
                raise ValueError("pass either a HookConfig or hook/wrapper/hook_options, not both.")
            self.hook_config = hook
        else:
            self.hook_config = HookConfig(hook, wrapper, dict(hook_options or {}))
        super().__init__(**kwargs)
        self._hook_group = hook_process_group
        self.hook_state: Any = None
        self._pending_hook_state: Mapping[str, Any] | None = None
        self._averager_attached = False

    def configure_ddp(self) -> None:
        """Wrap the model in DDP (as ``DDPStrategy`` does), then register the hook."""
        super().configure_ddp()
        if self._lightning_hook is not None:
            hook, state, wrapper = self._lightning_hook
            ddp: Any = self.model  # DistributedDataParallel once DDPStrategy configured it
            ddp.register_comm_hook(state, hook if wrapper is None else wrapper(hook))
            self.hook_state = state
        else:
            self.hook_state = register_from_config(self.model, self.hook_config, self._hook_group)
        pending, self._pending_hook_state = self._pending_hook_state, None
        if pending is not None:
            per_rank = self._per_rank()
            if per_rank is None:
                raise ValueError(
                    f"the checkpoint holds hook state, but hook '{self.hook_name}' keeps "
                    "none. Resume with the hook the checkpoint was trained with."
                )
            per_rank.load_state_dict(pending)

    @property
    def hook_name(self) -> str:
        """The hook this strategy registers: a ``ddp_comm_hook`` function's name, or the
        config's hook."""
        if self._lightning_hook is not None:
            return str(getattr(self._lightning_hook[0], "__name__", self._lightning_hook[0]))
        return str(self.hook_config.hook)

    def setup(self, trainer: Any) -> None:
        """Set up as ``DDPStrategy`` does, then attach a model averager that is the hook's
        state (DiLoCo's) to the optimizer, as ``DDPStrategy`` does for post-local SGD."""
        super().setup(trainer)
        self.attach_averager()

    def attach_averager(self) -> None:
        """Run the hook's model averager (DiLoCo's) after every step of the one optimizer
        (with several, each step would count as an inner step: ``ValueError``); once."""
        state = self.hook_state
        if not isinstance(state, ModelAverager) or self._averager_attached:
            return
        optimizers = list(self.optimizers)
        if len(optimizers) != 1:
            raise ValueError(
                f"hook '{self.hook_name}' runs a model averager after each step of one "
                f"optimizer, but the LightningModule configures {len(optimizers)}. Return one "
                "optimizer from configure_optimizers."
            )
        inner = getattr(optimizers[0], "_optimizer", optimizers[0])  # a LightningOptimizer's
        ddp: Any = self.model  # DistributedDataParallel once configure_ddp has run
        state.attach(inner, ddp.module.named_parameters())
        self._averager_attached = True

    def on_train_end(self) -> None:
        """Apply a DiLoCo fragment still in flight, on every rank, when training ends."""
        finish = getattr(self.hook_state, "finish", None)
        if isinstance(self.hook_state, ModelAverager) and callable(finish):
            finish()
        super().on_train_end()

    def _per_rank(self) -> PerRankState | None:
        state = self.hook_state
        if isinstance(state, StatelessState):  # nothing to keep: checkpoints stay as they were
            return None
        if not (hasattr(state, "state_dict") and hasattr(state, "load_state_dict")):
            return None
        return PerRankState(state, self._hook_group)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Add every rank's hook state to ``checkpoint`` (a collective: Lightning calls it on
        every rank), then save as ``DDPStrategy`` does."""
        per_rank = self._per_rank()
        if per_rank is not None:
            checkpoint[CHECKPOINT_KEY] = per_rank.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load as ``DDPStrategy`` does, and restore the hook state from it (kept until
        :meth:`configure_ddp` where, as on resuming, the DDP model does not exist yet)."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is not None:
            per_rank = self._per_rank()
            if per_rank is None:
                self._pending_hook_state = saved
            else:
                per_rank.load_state_dict(saved)
        return checkpoint


def _lightning_hook_args(
    kwargs: dict[str, Any], hook: Any, wrapper: Any, hook_options: Any, group: Any
) -> tuple[Any, Any, Any] | None:
    """Take ``DDPStrategy``'s hook arguments out of ``kwargs`` (it registers them only on CUDA;
    this strategy registers them itself): ``(hook, state, wrapper)``."""
    names = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper")
    given = {k: kwargs.pop(k, None) for k in names}
    if all(v is None for v in given.values()):
        return None
    if given["ddp_comm_hook"] is None:
        raise ValueError(
            "ddp_comm_state and ddp_comm_wrapper need ddp_comm_hook: pass the hook function too, "
            "or choose a hook by name with hook=..."
        )
    if hook is not None or wrapper is not None or hook_options or group is not None:
        raise ValueError(
            "pass either hook=..., wrapper=..., hook_options=..., hook_process_group=... or "
            "DDPStrategy's ddp_comm_hook=..., ddp_comm_state=..., ddp_comm_wrapper=..., not "
            "both (a ddp_comm_hook's group is its ddp_comm_state's)."
        )
    return given["ddp_comm_hook"], given["ddp_comm_state"], given["ddp_comm_wrapper"]
