"""The options of the averagers and of streaming DiLoCo, each spelled once, with its reason and
its check."""

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from commhooks.options import Options, count, flag, option, real

__all__ = [
    "AveragerOptions",
    "DiLoCoOptions",
    "Fragments",
    "HierarchicalAveragerOptions",
    "OptimizerFactory",
    "OuterOptimizerOptions",
    "OuterOptions",
    "PeriodicAveragerOptions",
]

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
Fragments = int | tuple[tuple[str, ...], ...]  # a number of fragments, or their module names


@dataclass(frozen=True, kw_only=True)
class AveragerOptions(Options):
    """The options every averager has."""

    owner: ClassVar[str] = "ModelAverager"

    warmup_steps: int = option(
        0, "steps that never average; match the hook's start_localSGD_iter", check=count(0)
    )


@dataclass(frozen=True, kw_only=True)
class PeriodicAveragerOptions(AveragerOptions):
    """The options of :class:`PeriodicModelAverager`."""

    owner: ClassVar[str] = "PeriodicModelAverager"

    period: int = option(
        reason="steps between two averagings; longer saves bandwidth, lets replicas drift",
        check=count(1, "Pass period=k to average every k steps."),
    )


def _check_levels(owner: str, name: str, levels: Any) -> tuple[tuple[int, int], ...]:
    """``{period: group size}`` as ``(period, size)`` pairs, checked for what needs no group."""
    if isinstance(levels, tuple):  # already checked (a copy made by Options.replace)
        levels = dict(levels)
    if not isinstance(levels, Mapping) or not levels:
        raise ValueError(
            f"{owner}: {name} must be a non-empty ordered mapping {{period: group size}}, "
            f"e.g. {{2: 2, 8: 16}} on 16 ranks; got {levels!r}."
        )
    pairs = tuple(
        (count(1)(owner, "every period", p), count(1)(owner, "every group size", s))
        for p, s in levels.items()
    )
    periods = [p for p, _ in pairs]
    if any(b <= a for a, b in zip(periods, periods[1:])):
        raise ValueError(
            f"{owner}: periods must be strictly increasing in {name}, got {periods}. List the "
            "smallest group with the shortest period first."
        )
    return pairs


@dataclass(frozen=True, kw_only=True)
class HierarchicalAveragerOptions(AveragerOptions):
    """The options of :class:`HierarchicalModelAverager`."""

    owner: ClassVar[str] = "HierarchicalModelAverager"

    period_group_size_dict: tuple[tuple[int, int], ...] = option(
        reason="{period: group size}, periods increasing; the largest group is the whole group",
        check=_check_levels,
    )


def _positive(owner: str, name: str, value: Any) -> float:
    number = real(hint="a learning rate")(owner, name, value)
    if number <= 0:
        raise ValueError(f"{owner}: {name} must be a positive number, got {value!r}.")
    return float(number)


@dataclass(frozen=True, kw_only=True)
class OuterOptions(AveragerOptions):
    """The outer optimizer's options, shared by the averagers that step one (DiLoCo's)."""

    owner: ClassVar[str] = "OuterOptimizerAverager"

    outer_lr: float = option(0.7, "learning rate of the default outer SGD", check=_positive)
    outer_momentum: float = option(
        0.9, "momentum of the default outer SGD, in [0, 1) (0: none)", check=real(0, 1)
    )
    nesterov: bool = option(True, "Nesterov momentum for the default outer SGD", check=flag())
    outer_optimizer: OptimizerFactory | None = option(
        None, "factory(list of tensors) -> optimizer, replacing the default outer SGD"
    )

    def check_together(self) -> None:
        if self.outer_momentum >= 1:
            raise ValueError(
                f"{self.owner}: outer_momentum must be in [0, 1), got {self.outer_momentum!r}."
            )
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise ValueError(
                f"{self.owner}: outer_optimizer must be a callable taking a list of tensors and "
                f"returning an optimizer, got {type(self.outer_optimizer).__name__}."
            )

    def factory(self) -> OptimizerFactory:
        """The outer optimizer's factory: the one given, or SGD with the three options."""
        if self.outer_optimizer is not None:
            return self.outer_optimizer
        momentum = self.outer_momentum
        return functools.partial(
            torch.optim.SGD,
            lr=self.outer_lr,
            momentum=momentum,
            nesterov=self.nesterov and momentum > 0,
        )

    def described(self) -> dict[str, Any]:
        """The options as every rank must agree on them: a factory by its name, in place of
        the default SGD's three options."""
        fields, given = self.as_dict(), self.outer_optimizer
        if given is None:
            del fields["outer_optimizer"]
            return fields
        for name in ("outer_lr", "outer_momentum", "nesterov"):
            del fields[name]
        named = repr(given) if isinstance(given, functools.partial) else _qualname(given)
        return {**fields, "outer_optimizer": named}


@dataclass(frozen=True, kw_only=True)
class OuterOptimizerOptions(OuterOptions, PeriodicAveragerOptions):
    """The options of :class:`OuterOptimizerAverager`."""

    owner: ClassVar[str] = "OuterOptimizerAverager"


def _check_fragments(owner: str, name: str, value: Any) -> Fragments:
    if isinstance(value, int) and not isinstance(value, bool):
        return int(count(1)(owner, name, value))
    given = value if isinstance(value, (list, tuple)) else None
    if given and all(
        isinstance(f, (list, tuple)) and f and all(isinstance(m, str) for m in f) for f in given
    ):
        return tuple(tuple(f) for f in given)
    raise ValueError(
        f"{owner}: {name} must be a number of fragments (cut by module, in order) or a list "
        "of fragments, each a non-empty list of module or parameter names, e.g. "
        f"[['embed', 'layers.0'], ['layers.1', 'head']]; got {value!r}."
    )


def _check_bits(owner: str, name: str, value: Any) -> int | None:
    if value is None or (value in (8, 4) and not isinstance(value, bool)):
        return None if value is None else int(value)
    raise ValueError(
        f"{owner}: {name} must be None (full precision), 8 or 4, got {value!r}. Pass {name}=4 "
        "to send them in 4 bits."
    )


@dataclass(frozen=True, kw_only=True)
class DiLoCoOptions(OuterOptions):
    """The options of :class:`StreamingDiLoCo`; every rank must build it with the same."""

    owner: ClassVar[str] = "StreamingDiLoCo"

    sync_every: int = option(
        reason="inner steps between two syncs of a fragment; longer sends less, drifts more",
        check=count(1, "Pass sync_every=H to sync every fragment every H inner steps."),
    )
    fragments: Fragments = option(
        1,
        "how many fragments, cut by module in order, or the fragments as lists of module names; "
        "one fragment is plain DiLoCo",
        check=_check_fragments,
    )
    fragment_sync_delay: int = option(
        0,
        "inner steps between issuing a fragment's average and applying it (the overlap)",
        check=count(0),
    )
    fragment_update_alpha: float = option(
        0.0,
        "weight of the local parameters against the global ones after a sync (0: global)",
        check=real(0, 1),
    )
    keep_inflight_steps: bool = option(
        False,
        "keep the inner steps taken while a fragment was in flight: it becomes the new global "
        "parameters plus its local change since it was issued, instead of dropping that change",
        check=flag(),
    )
    bits: int | None = option(
        None,
        "None sends outer gradients in float32; 8 or 4 quantizes them (4: codes of 13 levels "
        "packed eight to 30 bits, a scale per 512 values, 3.8125 bits a value)",
        check=_check_bits,
    )
    warmup_bits: int | None = option(
        None,
        "None averages the warm-up's gradients in float32; 8 or 4 quantizes them (the DDP hook "
        "of register(), with error feedback during the warm-up)",
        check=_check_bits,
    )

    @property
    def fragment_count(self) -> int:
        """How many fragments the model is cut into."""
        return self.fragments if isinstance(self.fragments, int) else len(self.fragments)

    @property
    def keeps_inflight_change(self) -> bool:
        """Whether an apply adds back a local change: ``keep_inflight_steps`` with a delay
        (without one, nothing changes between a fragment's issue and its apply)."""
        return self.keep_inflight_steps and self.fragment_sync_delay > 0

    @property
    def spacing(self) -> int:
        """Inner steps between the syncs of two consecutive fragments."""
        return self.sync_every // self.fragment_count

    def check_together(self) -> None:
        super().check_together()
        n, every = self.fragment_count, self.sync_every
        if every % n:
            raise ValueError(
                f"{self.owner}: sync_every={every} must be a multiple of the number of "
                f"fragments ({n}), so that their syncs are evenly spaced; use "
                f"sync_every={every // n * n or n}."
            )
        if self.fragment_sync_delay >= every // n:
            raise ValueError(
                f"{self.owner}: fragment_sync_delay={self.fragment_sync_delay} must be less than "
                f"sync_every / fragments = {every // n}, so that one fragment is in flight at a "
                f"time; use fragment_sync_delay <= {every // n - 1} or fewer fragments."
            )


def _qualname(obj: Any) -> str:
    return str(getattr(obj, "__qualname__", type(obj).__qualname__))
