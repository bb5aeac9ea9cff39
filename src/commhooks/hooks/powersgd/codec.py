"""PowerSGD state <-> its state dict: :func:`decode` checks every entry of a file, which may be
damaged or hostile, before anything is used, and names the entry it refuses."""

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from commhooks import place
from commhooks.compress import lowrank
from commhooks.compress.error_feedback import ErrorFeedback, Key
from commhooks.compress.factors import FactorMemory
from commhooks.hooks.buckets import Numbers, parse_buckets
from commhooks.state import StateDictError, check_count, check_tensor

from .options import COSMETIC, PowerSGDOptions

__all__ = ["COUNTS", "HOOKS", "Snapshot", "decode", "encode", "key_of"]

OWNER = "PowerSGDState"
LAYERWISE, BATCHED = "powerSGD_hook", "batched_powerSGD_hook"
HOOKS = (LAYERWISE, BATCHED)
_WHERE = "PowerSGDState.load_state_dict"
RngState = tuple[str, npt.NDArray[np.uint32], int, int, float]
"""What ``numpy.random.RandomState.get_state()`` returns and ``set_state`` takes."""
COUNTS = (
    "iter",
    "total_numel_before_compression",
    "total_numel_after_compression",
    "next_stats_report",
)
"""The state's counters: its step, and its compression statistics."""


@dataclass
class Snapshot:
    """Everything a PowerSGD state saves, decoded and checked; ``None`` where not known."""

    counts: dict[str, int]  # by the names of COUNTS
    rng: RngState
    world_size: int | None
    rank: int | None
    place: dict[str, int | str]  # mesh coordinates (commhooks.place)
    memory: ErrorFeedback
    factors: FactorMemory
    layouts: dict[str, tuple[int, ...]]
    hook: str | None
    buckets: list[Numbers]  # DDP's last step's (commhooks.hooks.buckets.SavedBuckets)


def key_of(name: object) -> Key:
    """A saved key back as a key: a parameter number, or ``"bucket<i>"``."""
    if not isinstance(name, str):
        raise TypeError(f"key {name!r} is not a string")
    digits = name[len("bucket") :] if name.startswith("bucket") else name
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(f"key {name!r} is neither a parameter number nor 'bucket<i>'")
    return name if digits != name else int(name)


def encode(snap: Snapshot, options: PowerSGDOptions) -> dict[str, Any]:
    """The state dict of ``snap`` (without the header :class:`~commhooks.state.HookState` adds)."""
    name, keys, pos, has_gauss, cached = snap.rng
    return {
        "options": options.as_dict(),
        **snap.counts,
        "rng": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "world_size": -1 if snap.world_size is None else snap.world_size,
        "rank": -1 if snap.rank is None else snap.rank,
        "place": dict(snap.place),
        "error": snap.memory.state_dict(),
        **snap.factors.state_dict(),
        "layouts": {k: list(v) for k, v in snap.layouts.items()},
        "hook": snap.hook,
        "buckets": [list(b) for b in snap.buckets],
    }


def decode(
    sd: Mapping[str, Any], options: PowerSGDOptions, describe: Callable[[Key], str]
) -> Snapshot:
    """Check and convert every entry of ``sd``; ``StateDictError`` for options that differ
    from ``options`` (but :data:`~.options.COSMETIC` ones), or any malformed entry."""
    _check_options(sd.get("options"), options)
    try:
        return _parse(sd, options, describe)
    except (StateDictError, KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        detail = f"missing entry {exc}" if isinstance(exc, KeyError) else str(exc)
        raise StateDictError(
            f"{_WHERE}: malformed PowerSGD state dict ({detail}). Pass the unchanged output of "
            "PowerSGDState.state_dict()."
        ) from exc


def _check_options(saved: Any, options: PowerSGDOptions) -> None:
    if not isinstance(saved, Mapping):
        raise StateDictError(
            f"{_WHERE}: malformed PowerSGD state dict ('options' must be the mapping of options "
            f"the state was built with, got {type(saved).__name__})."
        )
    here = options.as_dict()
    differing = [n for n in here if n not in COSMETIC and saved.get(n) != here[n]]
    if differing:
        details = ", ".join(f"{n}: saved {saved.get(n)!r}, here {here[n]!r}" for n in differing)
        raise StateDictError(
            f"{_WHERE}: the state was saved with other options ({details}). Build the state "
            "with the saved options (state_dict['options']) to resume, or start a new one."
        )


def _parse(
    sd: Mapping[str, Any], options: PowerSGDOptions, describe: Callable[[Key], str]
) -> Snapshot:
    memory = ErrorFeedback(OWNER, describe, lowrank.plausible_residual)
    memory.load_state_dict(sd["error"], key_of, "error")
    factors = FactorMemory(OWNER, describe)
    factors.load_state_dict(sd, key_of)
    _check_factor_shapes(dict(memory.items()), factors, options.matrix_approximation_rank)
    return Snapshot(
        counts={name: check_count(name, sd[name]) for name in COUNTS},
        rng=_rng(sd["rng"]),
        world_size=_known(check_count("world_size", sd["world_size"], minimum=-1)),
        rank=_known(check_count("rank", sd["rank"], minimum=-1)),
        place=place.checked("place", sd["place"]),
        memory=memory,
        factors=factors,
        layouts=_layouts(sd["layouts"]),
        hook=_hook(sd["hook"], memory, factors),
        buckets=parse_buckets(_WHERE, sd.get("buckets", [])),  # (absent from older files)
    )


def _known(count: int) -> int | None:
    return None if count < 0 else count  # -1: saved where torch.distributed was not running


def _check_factor_shapes(errors: dict[Key, torch.Tensor], factors: FactorMemory, rank: int) -> None:
    """Error ``(n, m)``, ``P`` ``(n, r)`` and ``Q`` ``(m, r)`` of a key agree, with
    ``r = min(rank, n, m)``, in one dtype; a key that alternates has both factors."""
    for key in factors.last_step:
        if key not in factors.p or key not in factors.q:
            raise ValueError(f"last_step[{str(key)!r}] has no factors p and q to go with it")
    for key in set(factors.p) | set(factors.q):
        error, p, q = errors.get(key), factors.p.get(key), factors.q.get(key)
        present = {"error": error, "p": p, "q": q}
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in present.items() if t is not None)
        dtypes = {t.dtype for t in (error, p, q) if t is not None}
        if len(dtypes) > 1 or not _factors_fit(error, p, q, rank):
            raise ValueError(
                f"the entries of key {str(key)!r} do not fit each other ({shapes}; "
                f"matrix_approximation_rank={rank}): an error (n, m) goes with p (n, r) and "
                "q (m, r) of one dtype, r = min(rank, n, m)"
            )


def _factors_fit(
    error: torch.Tensor | None, p: torch.Tensor | None, q: torch.Tensor | None, rank: int
) -> bool:
    if error is not None and error.dim() != 2:
        return False
    n = p.shape[0] if p is not None else error.shape[0] if error is not None else None
    m = q.shape[0] if q is not None else error.shape[1] if error is not None else None
    widths = {t.shape[1] for t in (p, q) if t is not None}
    if len(widths) != 1 or (error is not None and tuple(error.shape) != (n, m)):
        return False
    (r,) = widths
    bound = min(x for x in (rank, n, m) if x is not None)
    # r = min(rank, n, m) where n and m are both known; at most that otherwise.
    return 1 <= r <= bound and (n is None or m is None or r == bound)


def _rng(value: Any) -> RngState:
    """The numpy generator's state, checked on a scratch generator."""
    if not isinstance(value, Mapping):
        raise TypeError(f"rng must be a mapping, got {type(value).__name__}")
    if value["name"] != "MT19937":
        raise ValueError(f"rng['name'] must be 'MT19937', got {value['name']!r}")
    keys = check_tensor("rng['keys']", value["keys"], dtype=torch.int64, shape=(624,))
    if bool((keys < 0).any()) or bool((keys >= 2**32).any()):
        raise ValueError("rng['keys'] must hold 32-bit unsigned values")
    pos = check_count("rng['pos']", value["pos"])
    has_gauss = check_count("rng['has_gauss']", value["has_gauss"])
    cached = value["cached_gaussian"]
    if pos > 624 or has_gauss > 1:
        raise ValueError(f"rng['pos'] {pos} or rng['has_gauss'] {has_gauss} out of range")
    if not isinstance(cached, numbers.Real) or isinstance(cached, bool):
        raise TypeError(f"rng['cached_gaussian'] must be a number, got {cached!r}")
    if not math.isfinite(cached):
        raise ValueError(f"rng['cached_gaussian'] must be finite, got {cached!r}")
    state = ("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, float(cached))
    np.random.RandomState().set_state(state)
    return state


def _layouts(value: Any) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, Mapping):
        raise TypeError(f"layouts must be a mapping, got {type(value).__name__}")
    out: dict[str, tuple[int, ...]] = {}
    for name, numbers_ in value.items():
        if not isinstance(key_of(name), str) or not isinstance(numbers_, (list, tuple)):
            raise TypeError(f"layouts[{name!r}] must map 'bucket<i>' to a list of numbers")
        out[name] = tuple(check_count(f"layouts[{name!r}]", n) for n in numbers_)
    return out


def _hook(saved: Any, memory: ErrorFeedback, factors: FactorMemory) -> str | None:
    """The hook the state was saved by: as saved, or (before it was) told by its keys."""
    if saved is not None and saved not in HOOKS:
        raise ValueError(f"hook must be one of {', '.join(HOOKS)} or None, got {saved!r}")
    keys = [*memory, *factors.p, *factors.q]
    told = {BATCHED if isinstance(k, str) else LAYERWISE for k in keys}
    if len(told) > 1 or (saved is not None and told and told != {saved}):
        raise ValueError(f"entries of per-parameter and per-bucket keys, saved by hook {saved!r}")
    return saved if saved is not None else next(iter(told), None)
