"""Options and memory of the PowerSGD hooks, and which tensors of a bucket they compress.

Public through :mod:`commhooks.hooks.powersgd`, where the hooks that use it live.
"""

import logging
import numbers
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from commhooks import comm, handshake, lowrank
from commhooks._warnings import CommHooksWarning, warn_once
from commhooks.state import HookState, StateDictError

__all__ = ["OPTION_NAMES", "Key", "PowerSGDState"]

# The hooks' public module: where users look for the statistics it logs.
logger = logging.getLogger("commhooks.hooks.powersgd")

Key = int | str  # a parameter ordinal (layer-wise hook) or "bucket<i>" (batched hook)
_FROM_LAST, _FIRST_SEEN = "from_last", "first_seen"  # how parameters are numbered
_BOTH, _P_STEP, _Q_STEP = "pq", "p", "q"  # two rounds; single round refining P, or Q
# The single-round memory defers subtracting approximations until they stack up to this rank:
# one wider product a few steps apart costs less than a thin one every step.
_MAX_PENDING_RANK = 16


# ----------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------
class PowerSGDState(HookState):
    """Options and memory of :func:`powerSGD_hook` and :func:`batched_powerSGD_hook`.

    The arguments and their defaults are PyTorch's, so existing code ports by changing the
    import. ``matrix_approximation_rank`` and ``start_powerSGD_iter`` are the ones to tune.

    Args:
        process_group: group to average over; ``None`` for the default group.
        matrix_approximation_rank: rank ``r`` of the factors; lower compresses more. Try 1, 2, 4.
        start_powerSGD_iter: plain allreduce for this many steps first, because early training is
            sensitive to gradient error. Any value >= 0 works: state is kept per parameter, so
            DDP's bucket rebuild after the first step cannot misapply it.
        min_compression_rate: a matrix is compressed only if its factors are at least this many
            times smaller than it; others are averaged as they are.
        use_error_feedback: remember what compression dropped and add it to the next gradient.
            Costs one buffer the size of the compressed gradients.
        warm_start: start each step's power iteration from the last step's ``Q``.
        orthogonalization_epsilon: added to column norms when orthogonalising. Not needed for
            zero columns, which come out as zeros here.
        random_seed: seed of the projections, identical on every rank.
        compression_stats_logging_frequency: log :meth:`compression_stats` every this many steps
            (0 or less: every step, as PyTorch's state takes it).
        batch_tensors_with_same_shape: compress same-shaped matrices of a bucket with batched
            products; stacking them costs a copy, so it pays on GPUs with many small layers.
        single_round: one collective per bucket per step instead of two. Each step refines only
            one factor, alternately ``P`` (``P = M Q`` with the last ``Q``) and ``Q``
            (``Q = Mᵀ P`` with the last ``P``), and sends it packed with the uncompressed
            tensors. Half the rounds and latency; the approximation follows the gradient one step
            later, so it converges more slowly than the default at the same rank (error feedback
            makes up part of it). Needs ``warm_start``. Its error memory keeps the
            approximations sent as pending products, subtracted a few steps later in the pass
            that adds a gradient, which saves a pass over the gradients after the collective
            (the pending factors take up to ``16 (n + m)`` elements for an ``n x m`` matrix,
            3% of the gradients of a 6M-parameter MLP); ``error_dict`` and
            ``state_dict()`` show the errors themselves, converting the memory in place. On a
            step whose result is not finite, the gradients added are taken back out (the memory
            is the previous one to the rounding of that addition) and the bucket is sent again
            as plain allreduce would, so a loss scaler sees inf/NaN where it puts them.

    Raises:
        ValueError: an option out of range, with the fix in the message.
    """

    kind = "powersgd"
    # 2: parameters numbered from the last one (see _ordinals_of); 1 numbered them as first seen.
    version = 2
    _transient = ("_ordinals", "_next_ordinal", "_plans", "_checked_group")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
        single_round: bool = False,
    ) -> None:
        super().__init__(process_group)
        _validate(
            matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter,
            min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback,
            warm_start=warm_start,
            orthogonalization_epsilon=orthogonalization_epsilon,
            random_seed=random_seed,
            compression_stats_logging_frequency=compression_stats_logging_frequency,
            batch_tensors_with_same_shape=batch_tensors_with_same_shape,
            single_round=single_round,
        )
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        rate = min_compression_rate
        self.min_compression_rate = (
            int(rate) if isinstance(rate, (int, np.integer)) else float(rate)
        )
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = int(random_seed)
        # As PyTorch's state: 0 or less means every step.
        self.compression_stats_logging_frequency = max(1, int(compression_stats_logging_frequency))
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self.single_round = bool(single_round)
        # Draws one seed per bucket call wherever PyTorch's hook draws one, in bucket order,
        # which is the same on every rank; numpy's generator so the sequence is PyTorch's.
        self.rng = np.random.RandomState(self.random_seed)
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.next_stats_report = 0
        # The error memory. With the single-round variant an entry may hold the error plus
        # approximations not yet subtracted, kept in _pending (see _materialize).
        # ``error_dict`` subtracts them before it shows the entries.
        self._errors: dict[Key, torch.Tensor] = {}
        self._pending: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}
        self.q_memory_dict: dict[Key, torch.Tensor] = {}
        self.p_memory_dict: dict[Key, torch.Tensor] = {}
        self._last_step: dict[Key, str] = {}
        self._layouts: dict[str, tuple[int, ...]] = {}
        self._saved_world_size: int | None = None
        self._saved_rank: int | None = None
        self._numbering = _FROM_LAST
        self._restore_transient()

    def _restore_transient(self) -> None:
        if not hasattr(self, "_numbering"):  # pickled by a release that numbered as first seen
            self._numbering = _FIRST_SEEN
        self._ordinals: dict[int, tuple[weakref.ref, int]] = {}
        self._next_ordinal = 0
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._checked_group: Any = None

    # -- the reference's public methods -----------------------------------------------------
    def options(self) -> dict[str, Any]:
        """Every constructor argument except the process group."""
        return {name: getattr(self, name) for name in OPTION_NAMES}

    def handshake_fields(self) -> dict[str, Any]:
        """What every rank's state must agree on at the first step (see commhooks.handshake)."""
        return {**self.options(), "iter": self.iter}

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count one step when the last bucket of the step is handled."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("PowerSGD: compression starts after %d plain steps.", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, elements before compression, elements after)`` summed over all steps.

        "After" counts what was sent: both factors a step, or with ``single_round`` the one
        factor the step refines.
        """
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"PowerSGDState({opts}, iter={self.iter})"

    @property
    def error_dict(self) -> dict[Key, torch.Tensor]:
        """The error-feedback memory: what compression dropped, per parameter (or bucket).

        The single-round variant keeps it lazily (see :meth:`_materialize`); reading this
        attribute first brings every entry into the form of an error, in place, at the cost of
        one pass over the memory.
        """
        self._materialize()
        return self._errors

    @error_dict.setter
    def error_dict(self, value: dict[Key, torch.Tensor]) -> None:
        self._errors = dict(value)
        self._pending = {}

    # -- used by the hooks ------------------------------------------------------------------
    def _materialize(self) -> None:
        """Subtract the pending approximations the single-round variant keeps, in place.

        A single-round step adds its gradient into the memory and sends a factor of the sum;
        the new error is that sum minus ``P Qᵀ``. Subtracting ``P Qᵀ`` right away would cost a
        pass over the memory after the collective, so it is kept as pending instead: the
        factors of later steps are corrected for it on their thin results, and it is taken out
        of the memory in the pass that adds a gradient, once the pending products reach rank
        :data:`_MAX_PENDING_RANK` (every eighth step at rank 2). After the collective only
        ``P Qᵀ`` is written into the gradient.
        """
        for key in list(self._pending):
            self._materialize_key(key)

    def _materialize_key(self, key: Key) -> None:
        pending = self._pending_product(key)
        if pending is not None:
            lowrank.subtract_product_(self._errors[key], *pending)
        self._pending.pop(key, None)

    def _explicit_error(
        self, key: Key, shape: tuple[int, ...], like: torch.Tensor
    ) -> torch.Tensor | None:
        """The error memory of ``key`` in the form of an error (made so if it was not)."""
        self._materialize_key(key)
        return self._stored(self._errors, key, shape, like)

    def _pending_product(self, key: Key) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(P, Qᵀ)``, the products still to subtract from a memory, stacked; None if none.

        Products that do not fit the memory (it was reset, or replaced by one of another
        shape) are dropped.
        """
        pending = self._pending.get(key)
        if pending is None:
            return None
        memory = self._errors.get(key)
        p, qt = pending
        if memory is None or memory.dim() != 2 or (p.shape[0], qt.shape[1]) != memory.shape:
            del self._pending[key]
            return None
        return p.to(memory), qt.to(memory)

    def _push_pending(self, key: Key, p: torch.Tensor, qt: torch.Tensor) -> None:
        """Add ``P Qᵀ`` to the products still to subtract from the memory of ``key``."""
        old = self._pending.get(key)
        if old is None:
            self._pending[key] = (p.clone(), qt.clone())
        else:
            self._pending[key] = (torch.cat([old[0], p], 1), torch.cat([old[1], qt], 0))

    @staticmethod
    def _fold_due(pending: tuple[torch.Tensor, torch.Tensor] | None, rank: int) -> bool:
        """Whether products ``pending`` are subtracted from the memory at this step: when one
        more rank-``rank`` product would take them past :data:`_MAX_PENDING_RANK`."""
        return pending is not None and pending[0].shape[1] + rank > _MAX_PENDING_RANK

    def _group(self, owner: str) -> dist.ProcessGroup:
        group = comm.resolve_group(self.process_group, owner=owner)
        if self._checked_group is not group:
            # Blocking, once: ranks built with different options would issue collectives of
            # different shapes, which gloo reports as an abort and NCCL as a hang.
            # The step count too: ranks resumed at different steps would start compressing
            # at different steps, and their collectives would no longer match.
            handshake.agree(group, owner, self)
            self._reset_if_world_changed(group)
            self._checked_group = group
        return group

    def _reset_if_world_changed(self, group: dist.ProcessGroup) -> None:
        saved, self._saved_world_size = self._saved_world_size, None
        saved_rank, self._saved_rank = getattr(self, "_saved_rank", None), None
        if saved == group.size() and saved_rank is not None and self._errors:
            here = comm.group_rank(group)
            if saved_rank != here:
                self._forget_errors(
                    f"powersgd-rank-{saved_rank}-{here}",
                    f"it was saved by rank {saved_rank} and loaded by rank {here}: a checkpoint "
                    "written by one rank for all (Accelerate's save_state does that with a "
                    "registered object) holds that rank's memory only. Wrap the state in "
                    "commhooks.integrations.PerRankState to save every rank's.",
                )
            return
        if saved is None or saved == group.size() or not self._errors:
            return
        self._forget_errors(
            f"powersgd-world-{saved}-{group.size()}",
            f"it was saved with world size {saved} and is used with {group.size()}: each rank's "
            "memory is its own share of what compression dropped and does not carry over to "
            "another number of ranks.",
        )

    def _forget_errors(self, key: str, why: str) -> None:
        count = len(self._errors)
        self._errors.clear()
        self._pending.clear()
        warn_once(
            key,
            f"PowerSGDState: the error-feedback memory of {count} tensors was reset, because "
            f"{why} The warm-start factors and the step count were kept.",
        )

    def _compressing(self) -> bool:
        return self.iter >= self.start_powerSGD_iter

    def _ordinals_of(self, params: list[torch.Tensor]) -> tuple[int, ...]:
        """Stable numbers for parameters: their position in DDP's list, counted from the end.

        DDP's first step hands the hooks either one bucket with all its parameters in their
        order, or (with ``find_unused_parameters=True``) buckets of ``bucket_cap_mb`` that
        each hold a run of consecutive parameters in order, the last run first. Numbering
        each bucket's new parameters from its end, in the order the buckets come, gives the
        last parameter 0, the one before it 1, and so on in either case: a resumed run finds
        each parameter's state whatever its bucket sizes. (Not with parameters of several
        dtypes and ``find_unused_parameters=True``: DDP then buckets each dtype apart, and the
        runs of the dtypes interleave by bucket size.) States saved by releases that numbered
        parameters as first seen keep that numbering.
        """
        known = {}
        for p in params:
            entry = self._ordinals.get(id(p))
            if entry is not None and entry[0]() is p:
                known[id(p)] = entry[1]
        new = [p for p in params if id(p) not in known]
        for p in reversed(new) if self._numbering == _FROM_LAST else new:
            known[id(p)] = self._next_ordinal
            self._ordinals[id(p)] = (weakref.ref(p), self._next_ordinal)
            self._next_ordinal += 1
        return tuple(known[id(p)] for p in params)

    def _plan(self, ordinals: tuple[int, ...], grads: list[torch.Tensor]) -> "_Plan":
        plan = self._plans.get(ordinals)
        if plan is None:
            plan = _Plan.build(
                ordinals, grads, self.matrix_approximation_rank, self.min_compression_rate
            )
            self._plans[ordinals] = plan
        return plan

    def _count(self, before: int, after: int, bucket: dist.GradBucket) -> None:
        self.total_numel_before_compression += before
        self.total_numel_after_compression += after
        if bucket.is_last() and self.iter >= self.next_stats_report:
            rate, total_before, total_after = self.compression_stats()
            logger.info(
                "PowerSGD compression stats: step %d, %d elements before compression, %d after, "
                "rate %.2f",
                self.iter,
                total_before,
                total_after,
                rate,
            )
            self.next_stats_report = self.iter + self.compression_stats_logging_frequency

    def _stored(
        self, store: dict[Key, torch.Tensor], key: Key, shape: tuple[int, ...], like: torch.Tensor
    ) -> torch.Tensor | None:
        """``store[key]`` if it fits ``shape`` (moved to ``like``'s device/dtype), else None."""
        t = store.get(key)
        if t is None:
            return None
        if tuple(t.shape) != shape:
            del store[key]
            if store is self._errors:
                self._pending.pop(key, None)
            what = _describe(key, self._numbering)
            warn_once(
                f"powersgd-shape-{key}-{tuple(t.shape)}-{shape}",
                f"PowerSGDState: stored state {tuple(t.shape)} for {what} does not fit "
                f"its gradient now {shape}; it was reset (error memory to zero, factors to new "
                "random ones). This happens when a checkpoint of another model is loaded.",
            )
            return None
        if t.dtype != like.dtype or t.device != like.device:
            t = store[key] = t.to(device=like.device, dtype=like.dtype)
        return t

    def _bucket_order(self, key: str, signature: tuple[int, ...]) -> list[int] | None:
        """Where a whole-bucket state applies: the bucket's parameters in the state's order.

        The state of ``key`` was made for a bucket holding the parameters ``signature`` names
        in some order. If this bucket holds the same parameters in another order (a fresh
        DDP's first step, before it rebuilds its buckets), returns the positions in this
        bucket of the state's parameters, in the state's order: compressing the gradients
        gathered in that order keeps the state's numerics. Returns ``None`` when the order is
        the bucket's own; forgets the state, with a warning, when the parameters differ.
        """
        old = self._layouts.get(key)
        if old is None or old == signature:
            self._layouts[key] = signature
            return None
        if sorted(old) == sorted(signature) and len(set(old)) == len(old):
            where = {ordinal: i for i, ordinal in enumerate(signature)}
            return [where[ordinal] for ordinal in old]
        self._layouts[key] = signature
        dropped = [
            d
            for d in (self._errors, self.q_memory_dict, self.p_memory_dict)
            if d.pop(key, None) is not None
        ]
        self._pending.pop(key, None)
        self._last_step.pop(key, None)
        if dropped:
            warn_once(
                f"powersgd-layout-{key}",
                f"batched_powerSGD_hook: {_describe(key)} now holds other parameters than when "
                "its error memory and factors were made (DDP may split its buckets differently "
                "after the first step, and a restart with another bucket_cap_mb does), so that "
                "state was reset. Use powerSGD_hook, whose state is per parameter, to avoid this.",
            )
        return None

    # -- checkpointing ----------------------------------------------------------------------
    def _save(self) -> dict[str, Any]:
        name, keys, pos, has_gauss, cached = self.rng.get_state()
        return {
            "options": self.options(),
            "iter": self.iter,
            "total_numel_before_compression": self.total_numel_before_compression,
            "total_numel_after_compression": self.total_numel_after_compression,
            "next_stats_report": self.next_stats_report,
            "rng": {
                "name": str(name),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "world_size": _current_world_size(self.process_group),
            "rank": _current_rank(self.process_group),
            "error": _tensors_out(self.error_dict),  # errors, whatever form they were kept in
            "q": _tensors_out(self.q_memory_dict),
            "p": _tensors_out(self.p_memory_dict),
            "last_step": {str(k): v for k, v in self._last_step.items()},
            "layouts": {k: list(v) for k, v in self._layouts.items()},
            "numbering": self._numbering,
        }

    def _load(self, sd: Mapping[str, Any]) -> None:
        parsed = _parse_state_dict(sd, self.options())
        self.iter = parsed["iter"]
        self.total_numel_before_compression = parsed["before"]
        self.total_numel_after_compression = parsed["after"]
        self.next_stats_report = parsed["next_stats_report"]
        self.rng.set_state(parsed["rng"])
        self.error_dict, self.q_memory_dict = parsed["error"], parsed["q"]
        self.p_memory_dict, self._last_step = parsed["p"], parsed["last_step"]
        self._layouts = parsed["layouts"]
        self._numbering = parsed["numbering"]
        self._saved_world_size, self._saved_rank = parsed["world_size"], parsed["rank"]
        self._checked_group = None
        if self.use_error_feedback and self.iter > self.start_powerSGD_iter and not self._errors:
            warnings.warn(
                f"PowerSGDState.load_state_dict: the state is at step {self.iter}, past "
                f"start_powerSGD_iter={self.start_powerSGD_iter}, but holds no error-feedback "
                "memory, so training resumes without it. A checkpoint that keeps one copy of "
                "each key for all ranks (torch.distributed.checkpoint with a plain state_dict) "
                "loses it: save commhooks.integrations.DistributedCheckpointState(state).",
                CommHooksWarning,
                stacklevel=3,
            )


OPTION_NAMES = (
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "use_error_feedback",
    "warm_start",
    "orthogonalization_epsilon",
    "random_seed",
    "compression_stats_logging_frequency",
    "batch_tensors_with_same_shape",
    "single_round",
)
# Options that may change across a restart without making the saved memory meaningless.
_COSMETIC = ("compression_stats_logging_frequency", "start_powerSGD_iter")


def _validate(**o: Any) -> None:
    def is_int(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    def is_real(v: Any) -> bool:  # numpy scalars too; a bool is a flag given by mistake
        return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))

    checks = [
        (
            is_int(o["matrix_approximation_rank"]) and o["matrix_approximation_rank"] >= 1,
            "matrix_approximation_rank must be an integer >= 1 (try 1, 2 or 4)",
        ),
        (
            is_int(o["start_powerSGD_iter"]) and o["start_powerSGD_iter"] >= 0,
            "start_powerSGD_iter must be an integer >= 0 (0 compresses from the first step)",
        ),
        (
            is_real(o["min_compression_rate"]) and o["min_compression_rate"] >= 1,
            "min_compression_rate must be a number >= 1 (a rate below 1 would 'compress' a matrix "
            "into factors larger than itself)",
        ),
        (
            is_real(o["orthogonalization_epsilon"])
            and 0 <= o["orthogonalization_epsilon"] < float("inf"),
            "orthogonalization_epsilon must be a finite number >= 0 (0 is exact; zero columns are "
            "handled without it)",
        ),
        (
            is_int(o["random_seed"]) and 0 <= o["random_seed"] < 2**32,
            "random_seed must be an integer in [0, 2**32)",
        ),
        (
            is_int(o["compression_stats_logging_frequency"]),
            "compression_stats_logging_frequency must be an integer (steps between two logs of "
            "compression_stats(); 1 or less logs every step)",
        ),
    ]
    for flag in (
        "use_error_feedback",
        "warm_start",
        "batch_tensors_with_same_shape",
        "single_round",
    ):
        ok = isinstance(o[flag], (bool, np.bool_)) or (is_int(o[flag]) and o[flag] in (0, 1))
        checks.append((ok, f"{flag} must be True or False"))
    checks.append(
        (
            not (o["single_round"] and not o["warm_start"]),
            "single_round=True needs warm_start=True: each step refines one factor starting "
            "from the other one of the previous step. Set warm_start=True or single_round=False",
        ),
    )
    for ok, message in checks:
        if not ok:
            name = message.split(" ")[0].split("=")[0]
            raise ValueError(f"PowerSGDState: {message}; got {name}={o.get(name)!r}.")


def _describe(key: Key, numbering: str = _FROM_LAST) -> str:
    if isinstance(key, str):
        return f"bucket {key[len('bucket') :]}"
    if numbering == _FIRST_SEEN:
        return f"parameter #{key} (in the order DDP's first step presented them)"
    return f"parameter #{key} (counted from DDP's last parameter, 0 being the last)"


def _current_rank(group: dist.ProcessGroup | None) -> int:
    if dist.is_available() and dist.is_initialized():
        return comm.group_rank(group)
    return -1


def _current_world_size(group: dist.ProcessGroup | None) -> int:
    if dist.is_available() and dist.is_initialized():
        return comm.world_size(group)
    return -1


def _tensors_out(store: dict[Key, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Factors may be views into a larger buffer; clone so only their own elements are saved.
    return {str(k): t.detach().clone() for k, t in store.items()}


def _key_in(name: Any) -> Key:
    if not isinstance(name, str):
        raise TypeError(f"key {name!r} is not a string")
    return name if name.startswith("bucket") else int(name)


def _parse_state_dict(sd: Mapping[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """Check and convert everything first, so that a bad dict changes nothing."""
    where = "PowerSGDState.load_state_dict"
    try:
        saved_opts = dict(sd["options"])
        differing = [
            n for n in OPTION_NAMES if n not in _COSMETIC and saved_opts.get(n) != options[n]
        ]
        if differing:
            details = ", ".join(
                f"{n}: saved {saved_opts.get(n)!r}, here {options[n]!r}" for n in differing
            )
            raise StateDictError(
                f"{where}: the state was saved with other options ({details}). Build the state "
                "with the saved options (state_dict['options']) to resume, or start a new one."
            )
        rng = sd["rng"]
        keys = rng["keys"]
        if not isinstance(keys, torch.Tensor) or keys.shape != (624,):
            raise TypeError("rng.keys must be a tensor of 624 entries")
        rng_state = (
            str(rng["name"]),
            keys.to(torch.int64).numpy().astype(np.uint32),
            int(rng["pos"]),
            int(rng["has_gauss"]),
            float(rng["cached_gaussian"]),
        )
        np.random.RandomState().set_state(rng_state)  # validates it on a scratch generator
        stores = {}
        for name in ("error", "q", "p"):
            store = {}
            for k, t in dict(sd[name]).items():
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    raise TypeError(f"{name}[{k!r}] must be a floating-point tensor")
                if name != "error" and t.dim() != 2:
                    raise TypeError(f"{name}[{k!r}] must be a 2-D factor")
                store[_key_in(k)] = t
            stores[name] = store
        last_step = {_key_in(k): str(v) for k, v in dict(sd["last_step"]).items()}
        if not set(last_step.values()) <= {_P_STEP, _Q_STEP}:
            raise ValueError("last_step values must be 'p' or 'q'")
        parsed = {
            "iter": _nonneg_int(sd["iter"], "iter"),
            "before": _nonneg_int(sd["total_numel_before_compression"], "numel before"),
            "after": _nonneg_int(sd["total_numel_after_compression"], "numel after"),
            "next_stats_report": _nonneg_int(sd["next_stats_report"], "next_stats_report"),
            "rng": rng_state,
            "world_size": int(sd["world_size"]),
            "rank": int(sd.get("rank", -1)),  # not in dicts of earlier releases
            "error": stores["error"],
            "q": stores["q"],
            "p": stores["p"],
            "last_step": last_step,
            "layouts": {str(k): tuple(int(i) for i in v) for k, v in dict(sd["layouts"]).items()},
            # Version 1 numbered the parameters as first seen.
            "numbering": str(sd["numbering"]) if sd.get("version", 1) >= 2 else _FIRST_SEEN,
        }
        if parsed["numbering"] not in (_FROM_LAST, _FIRST_SEEN):
            raise ValueError(f"numbering must be {_FROM_LAST!r} or {_FIRST_SEEN!r}")
    except StateDictError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        missing = f"missing entry {exc}" if isinstance(exc, KeyError) else str(exc)
        raise StateDictError(
            f"{where}: malformed PowerSGD state dict ({missing}). Pass the unchanged output of "
            "PowerSGDState.state_dict()."
        ) from exc
    for name in ("world_size", "rank"):
        if parsed[name] < 0:
            parsed[name] = None
    return parsed


def _nonneg_int(value: Any, what: str) -> int:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return int(value)


# ----------------------------------------------------------------------------------------------
# Which tensors of a bucket are compressed (cached per bucket layout)
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    """The split of a bucket, in the order PyTorch draws projections: by shape, then position."""

    compressed: tuple[tuple[int, int, int, int, int], ...]  # (tensor index, ordinal, n, m, r)
    uncompressed: tuple[int, ...]
    numel_before: int
    numel_after: int
    uncompressed_numel: int

    @staticmethod
    def build(
        ordinals: tuple[int, ...], grads: list[torch.Tensor], rank: int, min_rate: float
    ) -> "_Plan":
        by_shape: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = {}
        uncompressed: list[int] = []
        before = after = unc = 0
        for i, (ordinal, grad) in enumerate(zip(ordinals, grads)):
            n, m = lowrank.as_matrix(grad).shape
            r = lowrank.effective_rank(n, m, rank)
            full, small = lowrank.compression_sizes(n, m, r)
            before += full
            if lowrank.should_compress(n, m, r, min_rate):
                by_shape.setdefault((n, m), []).append((i, ordinal, n, m, r))
                after += small
            else:
                uncompressed.append(i)
                after += full
                unc += full
        compressed = tuple(e for group in by_shape.values() for e in group)
        return _Plan(compressed, tuple(uncompressed), before, after, unc)


# Pickles and reprs name the public module, whichever module defines the class.
PowerSGDState.__module__ = "commhooks.hooks.powersgd"
