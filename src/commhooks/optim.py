"""An optimizer that runs a model averager after every step, for post-local SGD.

    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                PeriodicModelAverager(period=4, warmup_steps=100))
    ...
    loss.backward()
    opt.step()  # local step, then parameter averaging when due

It is a ``torch.optim.Optimizer`` (learning-rate schedulers accept it) whose ``state_dict`` holds
the inner optimizer's state and the averager's, and loads with ``weights_only=True``. The dict
is the inner optimizer's own plus ``step`` (PyTorch's wrapper format) and ``averager``.
"""

import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

from commhooks._warnings import CommHooksWarning
from commhooks.averagers import ModelAverager
from commhooks.state import HookState, StateDictError

__all__ = ["PostLocalSGDOptimizer"]

_INNER_KEYS = ("state", "param_groups")


class PostLocalSGDOptimizer(HookState, torch.optim.Optimizer):
    """Wraps ``optim``; ``step()`` runs it, then ``averager.average_parameters``.

    Args:
        optim: the local (inner) optimizer.
        averager: a :class:`commhooks.averagers.ModelAverager`; its ``warmup_steps`` should equal
            the hook's ``start_localSGD_iter``.
    """

    kind: ClassVar[str] = "post_local_sgd_optimizer"

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

    # Properties rather than copies: the inner optimizer replaces its lists when it loads.
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """One local step, then parameter averaging if the averager's schedule says so."""
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        self.averager.average_parameters(self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"PostLocalSGDOptimizer({self.optim!r}, averager={type(self.averager).__name__})"

    def _save(self) -> dict[str, Any]:
        # A superset of PyTorch's format (the inner optimizer's dict plus the averager's
        # "step"), so tools that read "state"/"param_groups" and PyTorch's own wrapper can use it.
        inner = self.optim.state_dict()
        return {**inner, "step": self.averager.step, "averager": self.averager.state_dict()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the inner optimizer and the averager; nothing changes if either is invalid.

        Also accepts the format of PyTorch's ``PostLocalSGDOptimizer`` (the inner optimizer's
        dict plus the averager's ``step``), so its checkpoints resume here.
        """
        if (
            isinstance(state_dict, Mapping)
            and "kind" not in state_dict
            and "param_groups" in state_dict
        ):
            self._load_reference_format(state_dict)
            return
        super().load_state_dict(state_dict)

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        name = f"{type(self).__name__}.load_state_dict"
        averager = state_dict.get("averager")
        inner = {k: v for k, v in state_dict.items() if k in _INNER_KEYS}
        if not isinstance(averager, Mapping) or len(inner) != len(_INNER_KEYS):
            raise StateDictError(
                f"{name}: the inner optimizer's 'state'/'param_groups' or the 'averager' entry "
                "is missing or malformed."
            )
        self.averager._check_header(averager)
        parsed = self.averager._parse(averager)
        self._load_inner(inner)
        self.averager._apply(parsed)

    def _load_inner(self, inner: Mapping[str, Any]) -> None:
        try:
            self.optim.load_state_dict(dict(inner))
        except (KeyError, ValueError, TypeError) as exc:
            raise StateDictError(
                f"{type(self).__name__}.load_state_dict: the inner optimizer's state does not fit "
                f"{type(self.optim).__name__}: {exc}"
            ) from exc

    def _load_reference_format(self, state_dict: Mapping[str, Any]) -> None:
        step = state_dict.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateDictError(f"PostLocalSGDOptimizer.load_state_dict: bad 'step' {step!r}.")
        if "step" not in state_dict:
            warnings.warn(
                "PostLocalSGDOptimizer.load_state_dict: no averager step in the state dict; the "
                "averager restarts at step 0 (its warm-up runs again).",
                CommHooksWarning,
                stacklevel=3,
            )
        self._load_inner({k: v for k, v in state_dict.items() if k != "step"})
        self.averager._apply({**self.averager._parse(self.averager.state_dict()), "step": step})
