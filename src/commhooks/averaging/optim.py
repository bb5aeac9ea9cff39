"""PyTorch's ``PostLocalSGDOptimizer``: an optimizer that runs a model averager after each step.

    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                PeriodicModelAverager(period=4, warmup_steps=100))
    ...
    loss.backward()
    opt.step()  # local step, then parameter averaging when due

Kept so that code written for PyTorch ports by changing the import: a thin shell over
:meth:`commhooks.averaging.averagers.ModelAverager.attach` (which new code can call directly),
and a ``torch.optim.Optimizer`` that schedulers accept. Its ``state_dict`` is the inner
optimizer's plus ``step`` (PyTorch's format) and ``averager``.
"""

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, overload

import torch

from commhooks._warnings import CommHooksWarning
from commhooks.averaging.averagers import ModelAverager
from commhooks.state import HookState, StateDictError, check_count, check_optimizer_state

__all__ = ["PostLocalSGDOptimizer"]

_INNER_KEYS = ("state", "param_groups")


class PostLocalSGDOptimizer(HookState, torch.optim.Optimizer):
    """Wraps ``optim``, to which ``averager`` is attached (:meth:`ModelAverager.attach`), so
    that it averages after every step; its ``warmup_steps`` should equal the hook's
    ``start_localSGD_iter``."""

    kind: ClassVar[str] = "post_local_sgd_optimizer"
    _transient: ClassVar[tuple[str, ...]] = ("_handle",)

    # torch.optim.Optimizer.__init__ is deliberately not called: the inner optimizer owns the
    # parameter groups and the state, and this object only forwards to it.
    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(
                f"PostLocalSGDOptimizer wraps a torch.optim.Optimizer, got {type(optim).__name__}."
            )
        if not isinstance(averager, ModelAverager):
            raise TypeError(
                "PostLocalSGDOptimizer needs a commhooks model averager (PeriodicModelAverager, "
                f"HierarchicalModelAverager, ...), got {type(averager).__name__}."
            )
        HookState.__init__(self, None)
        self.optim = optim
        self.averager = averager
        self._restore_transient()

    def _restore_transient(self) -> None:
        # Optimizers do not pickle their hooks: attach again after unpickling.
        self._handle = self.averager.attach(self.optim)

    # Properties rather than copies: the inner optimizer replaces its lists when it loads.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state."""
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optim.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's defaults."""
        return self.optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optim.defaults = value

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One local step; the averager then averages if its schedule says so."""
        return self.optim.step() if closure is None else self.optim.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The inner optimizer's ``add_param_group``."""
        self.optim.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"PostLocalSGDOptimizer({self.optim!r}, averager={type(self.averager).__name__})"

    def _save(self) -> dict[str, Any]:
        # A superset of PyTorch's format (the inner optimizer's dict plus the averager's
        # "step"), so tools that read "state"/"param_groups" and PyTorch's own wrapper can use it.
        inner = self.optim.state_dict()
        return {**inner, "step": self.averager.step, "averager": self.averager.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the inner optimizer and the averager, both or neither. Also takes PyTorch's
        format, whose ``step`` sets the averager's step (without it, as PyTorch does, a warning
        and step 0).

        Raises:
            StateDictError: a dict that does not fit the inner optimizer or the averager.
        """
        if (
            isinstance(state_dict, Mapping)
            and "kind" not in state_dict
            and "param_groups" in state_dict
        ):
            self._load_parts(state_dict, None)
            return
        super().load_state_dict(state_dict)

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        averager = state_dict.get("averager")
        if not isinstance(averager, Mapping):
            raise StateDictError(
                f"{type(self).__name__}.load_state_dict: the 'averager' entry is missing or "
                "malformed; pass the unchanged output of state_dict()."
            )
        self._load_parts(state_dict, averager)

    def _load_parts(
        self, state_dict: Mapping[str, Any], averager: Mapping[str, Any] | None
    ) -> None:
        """Load the averager's entry (if any), then the inner optimizer, then the step."""
        name = f"{type(self).__name__}.load_state_dict"
        inner = {k: v for k, v in state_dict.items() if k in _INNER_KEYS}
        params = [p for group in self.optim.param_groups for p in group["params"]]
        inner = check_optimizer_state(f"{name}: the inner optimizer's state", inner, params)
        step = state_dict.get("step")
        if step is not None:
            step = check_count(f"{name}: 'step'", step)
        before = copy.deepcopy(self.averager.state_dict())
        if averager is not None:
            self.averager.load_state_dict(averager)
        try:
            self.optim.load_state_dict(inner)
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            self.averager.load_state_dict(before)
            raise StateDictError(
                f"{name}: the inner optimizer's state does not fit {type(self.optim).__name__}: "
                f"{exc}"
            ) from exc
        self._set_step(step)

    def _set_step(self, step: int | None) -> None:
        if step is None:
            warnings.warn(
                "PostLocalSGDOptimizer.load_state_dict: the state dict holds no 'step' (the "
                "averager's step counter), so the averager restarts at step 0 and its "
                "warm-up runs again.",
                CommHooksWarning,
                stacklevel=4,
            )
            step = 0
        self.averager.step = step
