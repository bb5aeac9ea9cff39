"""PowerSGD: low-rank gradient compression with error feedback and warm start.

``powerSGD_hook`` compresses each gradient matrix of a bucket to rank-``r`` factors ``P`` (n x r)
and ``Q`` (m x r) and averages those instead of the matrix; vectors and matrices too small to
gain are averaged as they are. ``batched_powerSGD_hook`` treats the whole bucket as one
zero-padded square matrix. Both take a :class:`PowerSGDState`.

How this differs from PyTorch's hooks of the same names (the numerics of the default options
are the same):

* State is kept per parameter, not per bucket, so DDP's bucket rebuild after the first step,
  a restart, or another ``bucket_cap_mb`` can never apply one layer's error to another layer;
  ``start_powerSGD_iter`` may therefore be 0 or 1.
* First-round collectives are issued on DDP's thread, in bucket order; the ``Q`` round, which
  needs ``P``'s result, goes through :func:`commhooks.comm.issuer_for` to a follow-up group of
  its own, in the order its slots were reserved. Ranks therefore issue the same collectives in
  the same order on each group whatever the thread timing: many buckets work on gloo.
* The uncompressed tensors' allreduce starts before the compression work, together with the
  ``P`` round, instead of before it; no device-wide synchronisation; error feedback adds the
  remembered error into the gradient in place instead of cloning the bucket. Like PyTorch, it
  also remembers ``local - mean`` for the tensors sent uncompressed (small, and keeping it makes
  the numerics PyTorch's to the last bit where the order of operations allows).
* ``single_round=True`` sends one collective per bucket per step (see :class:`PowerSGDState`).

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import logging
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from commhooks import comm, lowrank
from commhooks._warnings import warn_once
from commhooks.hooks._bucket import float_buffer
from commhooks.state import HookState, StateDictError

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]

logger = logging.getLogger(__name__)

Key = int | str  # a parameter ordinal (layer-wise hook) or "bucket<i>" (batched hook)
_BOTH, _P_STEP, _Q_STEP = "pq", "p", "q"  # two rounds; single round refining P, or Q


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
        compression_stats_logging_frequency: log :meth:`compression_stats` every this many steps.
        batch_tensors_with_same_shape: compress same-shaped matrices of a bucket with batched
            products; stacking them costs a copy, so it pays on GPUs with many small layers.
        single_round: one collective per bucket per step instead of two. Each step refines only
            one factor, alternately ``P`` (``P = M Q`` with the last ``Q``) and ``Q``
            (``Q = Mᵀ P`` with the last ``P``), and sends it packed with the uncompressed
            tensors. Half the rounds and latency; the approximation follows the gradient one step
            later, so it converges more slowly than the default at the same rank (error feedback
            makes up part of it). Needs ``warm_start``.

    Raises:
        ValueError: an option out of range, with the fix in the message.
    """

    kind = "powersgd"
    version = 1
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
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = int(random_seed)
        self.compression_stats_logging_frequency = int(compression_stats_logging_frequency)
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self.single_round = bool(single_round)
        # Draws one seed per bucket call that needs fresh projections, in bucket order, which
        # is the same on every rank; numpy's generator so the sequence is PyTorch's.
        self.rng = np.random.RandomState(self.random_seed)
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.next_stats_report = 0
        self.error_dict: dict[Key, torch.Tensor] = {}
        self.q_memory_dict: dict[Key, torch.Tensor] = {}
        self.p_memory_dict: dict[Key, torch.Tensor] = {}
        self._last_step: dict[Key, str] = {}
        self._layouts: dict[str, tuple[int, ...]] = {}
        self._saved_world_size: int | None = None
        self._restore_transient()

    def _restore_transient(self) -> None:
        self._ordinals: dict[int, tuple[weakref.ref, int]] = {}
        self._next_ordinal = 0
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self._checked_group: Any = None

    # -- the reference's public methods -----------------------------------------------------
    def options(self) -> dict[str, Any]:
        """Every constructor argument except the process group."""
        return {name: getattr(self, name) for name in OPTION_NAMES}

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count one step when the last bucket of the step is handled."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("PowerSGD: compression starts after %d plain steps.", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, elements before compression, elements after)`` summed over all steps."""
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"PowerSGDState({opts}, iter={self.iter})"

    # -- used by the hooks ------------------------------------------------------------------
    def _group(self, owner: str) -> dist.ProcessGroup:
        group = comm.resolve_group(self.process_group, owner=owner)
        if self._checked_group is not group:
            # Blocking, once: ranks built with different options would issue collectives of
            # different shapes, which gloo reports as an abort and NCCL as a hang.
            comm.check_same_on_all_ranks(self.options(), group, owner="PowerSGDState")
            self._reset_if_world_changed(group)
            self._checked_group = group
        return group

    def _reset_if_world_changed(self, group: dist.ProcessGroup) -> None:
        saved, self._saved_world_size = self._saved_world_size, None
        if saved is None or saved == group.size() or not self.error_dict:
            return
        count = len(self.error_dict)
        self.error_dict.clear()
        warn_once(
            f"powersgd-world-{saved}-{group.size()}",
            f"PowerSGDState: the error-feedback memory of {count} tensors was reset, because "
            f"it was saved with world size {saved} and is used with {group.size()}: each rank's "
            "memory is its own share of what compression dropped and does not carry over to "
            "another number of ranks. The warm-start factors and the step count were kept.",
        )

    def _compressing(self) -> bool:
        return self.iter >= self.start_powerSGD_iter

    def _ordinals_of(self, params: list[torch.Tensor]) -> tuple[int, ...]:
        """Stable numbers for parameters, in the order first seen.

        DDP's first step hands the hooks every parameter in the same order in every fresh
        process (one bucket holding all of them, or its initial buckets in index order), so a
        resumed run numbers its parameters as the original did, whatever the bucket sizes.
        """
        out = []
        for p in params:
            entry = self._ordinals.get(id(p))
            if entry is None or entry[0]() is not p:
                entry = (weakref.ref(p), self._next_ordinal)
                self._ordinals[id(p)] = entry
                self._next_ordinal += 1
            out.append(entry[1])
        return tuple(out)

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
            warn_once(
                f"powersgd-shape-{key}-{tuple(t.shape)}-{shape}",
                f"PowerSGDState: stored state {tuple(t.shape)} for {_describe(key)} does not fit "
                f"its gradient now {shape}; it was reset (error memory to zero, factors to new "
                "random ones). This happens when a checkpoint of another model is loaded.",
            )
            return None
        if t.dtype != like.dtype or t.device != like.device:
            t = store[key] = t.to(device=like.device, dtype=like.dtype)
        return t

    def _check_layout(self, key: str, signature: tuple[int, ...]) -> None:
        """Forget a whole-bucket state when the bucket now holds other parameters."""
        old = self._layouts.get(key)
        self._layouts[key] = signature
        if old is None or old == signature:
            return
        dropped = [
            d
            for d in (self.error_dict, self.q_memory_dict, self.p_memory_dict)
            if d.pop(key, None) is not None
        ]
        self._last_step.pop(key, None)
        if dropped:
            warn_once(
                f"powersgd-layout-{key}",
                f"batched_powerSGD_hook: {_describe(key)} now holds other parameters than when "
                "its error memory and factors were made (DDP rebuilds its buckets after the "
                "first step, and a restart may bucket differently), so that state was reset. "
                "Use powerSGD_hook, whose state is per parameter, to avoid this.",
            )

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
            "error": _tensors_out(self.error_dict),
            "q": _tensors_out(self.q_memory_dict),
            "p": _tensors_out(self.p_memory_dict),
            "last_step": {str(k): v for k, v in self._last_step.items()},
            "layouts": {k: list(v) for k, v in self._layouts.items()},
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
        self._saved_world_size = parsed["world_size"]
        self._checked_group = None


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
            isinstance(o["min_compression_rate"], (int, float))
            and not isinstance(o["min_compression_rate"], bool)
            and o["min_compression_rate"] >= 1,
            "min_compression_rate must be a number >= 1 (a rate below 1 would 'compress' a matrix "
            "into factors larger than itself)",
        ),
        (
            isinstance(o["orthogonalization_epsilon"], (int, float))
            and 0 <= o["orthogonalization_epsilon"] < float("inf"),
            "orthogonalization_epsilon must be a finite number >= 0 (0 is exact; zero columns are "
            "handled without it)",
        ),
        (
            is_int(o["random_seed"]) and 0 <= o["random_seed"] < 2**32,
            "random_seed must be an integer in [0, 2**32)",
        ),
        (
            is_int(o["compression_stats_logging_frequency"])
            and o["compression_stats_logging_frequency"] >= 1,
            "compression_stats_logging_frequency must be an integer >= 1",
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


def _describe(key: Key) -> str:
    return f"bucket {key[len('bucket') :]}" if isinstance(key, str) else f"parameter #{key}"


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
            "error": stores["error"],
            "q": stores["q"],
            "p": stores["p"],
            "last_step": last_step,
            "layouts": {str(k): tuple(int(i) for i in v) for k, v in dict(sd["layouts"]).items()},
        }
    except StateDictError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        missing = f"missing entry {exc}" if isinstance(exc, KeyError) else str(exc)
        raise StateDictError(
            f"{where}: malformed PowerSGD state dict ({missing}). Pass the unchanged output of "
            "PowerSGDState.state_dict()."
        ) from exc
    if parsed["world_size"] < 0:
        parsed["world_size"] = None
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


# ----------------------------------------------------------------------------------------------
# One bucket's compression, as named steps
# ----------------------------------------------------------------------------------------------
@dataclass
class _Entry:
    key: Key
    matrix: torch.Tensor  # (n, m): where M is built and the approximation is written
    rank: int
    step: str
    error_in_matrix: bool = False  # the remembered error was added to a gradient view
    pending_error: torch.Tensor | None = None  # to add while computing the first product


@dataclass
class _Group:
    """Entries of one shape and step, compressed with one batched product (or one entry)."""

    entries: list[_Entry]
    stack: torch.Tensor  # (B, n, m): a view of the single entry's matrix, or a stacked copy
    known: torch.Tensor | None = None  # the factor the step starts from, (B, ., r)
    sent: torch.Tensor | None = None  # the factor the step sends, a view into a send buffer

    @property
    def stacked(self) -> bool:
        return len(self.entries) > 1


@dataclass
class _Call:
    """Everything one hook call needs after its collectives complete."""

    state: PowerSGDState
    bucket: dist.GradBucket
    buffer: torch.Tensor
    group: dist.ProcessGroup
    entries: list[_Entry]
    uncompressed: list[torch.Tensor]
    uncompressed_keys: list[Key] = field(default_factory=list)
    writeback: Callable[[], None] | None = None
    groups: list[_Group] = field(default_factory=list)
    _scratch: torch.Tensor | None = None

    def scratch(self) -> torch.Tensor:
        """One block's worth of working memory for the blocked products, made once per call."""
        if self._scratch is None:
            self._scratch = torch.empty(
                max((lowrank.scratch_elements(g.stack[0]) for g in self.groups), default=0),
                dtype=self.buffer.dtype,
                device=self.buffer.device,
            )
        return self._scratch


def _compensate_uncompressed(call: _Call) -> None:
    """Add the remembered error to each tensor sent as it is."""
    state = call.state
    if not state.use_error_feedback:
        return
    for key, t in zip(call.uncompressed_keys, call.uncompressed):
        error = state._stored(state.error_dict, key, tuple(t.shape), t)
        if error is not None:
            t.add_(error)


def _compensate_matrices(call: _Call, fuse: bool = False) -> None:
    """Add the remembered error to each matrix, so M = gradient + previous error.

    With ``fuse``, the addition is left to the first product (see :func:`_compute_sent`),
    which then reads the gradient once instead of twice. Only where each matrix is its own
    group: a stacked group copies the matrices, which must already hold M.
    """
    state = call.state
    if not state.use_error_feedback:
        return
    fuse = fuse and not state.batch_tensors_with_same_shape
    for e in call.entries:
        error = state._stored(state.error_dict, e.key, tuple(e.matrix.shape), e.matrix)
        if error is None:
            continue
        if fuse:
            e.pending_error = error
        else:
            e.matrix.add_(error)
        e.error_in_matrix = True


def _form_groups(call: _Call) -> None:
    batch = call.state.batch_tensors_with_same_shape
    by_kind: dict[tuple, list[_Entry]] = {}
    for e in call.entries:
        kind = (tuple(e.matrix.shape), e.rank, e.step) if batch else (id(e),)
        by_kind.setdefault(kind, []).append(e)
    for entries in by_kind.values():
        stack = (
            torch.stack([e.matrix for e in entries])
            if len(entries) > 1
            else entries[0].matrix.unsqueeze(0)
        )
        call.groups.append(_Group(entries, stack))


def _known_shape(g: _Group) -> tuple[int, int, int]:
    b, n, m = g.stack.shape
    rank = g.entries[0].rank
    return (b, n, rank) if g.entries[0].step == _Q_STEP else (b, m, rank)


def _sent_shape(g: _Group) -> tuple[int, int, int]:
    b, n, m = g.stack.shape
    rank = g.entries[0].rank
    return (b, m, rank) if g.entries[0].step == _Q_STEP else (b, n, rank)


def _prepare_known_factors(call: _Call, known: torch.Tensor) -> None:
    """Fill each group's starting factor: the stored one (warm start) or a random projection.

    A bucket call that needs any random projection draws one seed from the state's numpy
    generator and samples, in group order, on a private CPU generator: the same values on
    every rank, PyTorch's sequence, and the global RNG untouched.
    """
    state, offset, gen = call.state, 0, None
    for g in call.groups:
        shape = _known_shape(g)
        g.known = _factor_view(
            known[offset : offset + _numel(shape)], shape, is_q=g.entries[0].step != _Q_STEP
        )
        offset += _numel(shape)
        store = state.p_memory_dict if g.entries[0].step == _Q_STEP else state.q_memory_dict
        warm = state.warm_start or state.single_round
        stored = [
            state._stored(store, e.key, shape[1:], known) if warm else None for e in g.entries
        ]
        missing = [i for i, t in enumerate(stored) if t is None]
        if missing and gen is None:
            gen = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        if len(missing) == len(g.entries):
            g.known.copy_(torch.randn(shape, generator=gen, dtype=known.dtype))
        else:
            for i, t in enumerate(stored):
                if t is None:
                    t = torch.randn((1, *shape[1:]), generator=gen, dtype=known.dtype)
                g.known[i].copy_(t.reshape(shape[1:]))
    _orthogonalize_all(call, known, _known_shape, lambda g: g.entries[0].step != _Q_STEP)


def _orthogonalize_all(
    call: _Call,
    flat: torch.Tensor,
    shape_of: Callable[[_Group], tuple[int, int, int]],
    is_q: Callable[[_Group], bool],
) -> None:
    """Orthogonalise every group's factor in ``flat``, laid out one group after another.

    Consecutive groups whose factors have the same shape and layout are one stack in ``flat``:
    they are orthogonalised with one batched call each (a bucket's layers mostly share a few
    widths), which saves many small per-layer operations on the critical path.
    """
    runs: list[list] = []  # [start, end, batch, rows, rank, is_q]
    offset = 0
    for g in call.groups:
        b, rows, rank = shape_of(g)
        end = offset + b * rows * rank
        q = is_q(g)
        last = runs[-1] if runs else None
        if last is not None and last[1] == offset and tuple(last[3:]) == (rows, rank, q):
            last[1], last[2] = end, last[2] + b
        else:
            runs.append([offset, end, b, rows, rank, q])
        offset = end
    for start, end, b, rows, rank, q in runs:
        stack = _factor_view(flat[start:end], (b, rows, rank), is_q=q)
        lowrank.orthogonalize_(stack, call.state.orthogonalization_epsilon)


def _factor_view(flat: torch.Tensor, shape: tuple[int, int, int], is_q: bool) -> torch.Tensor:
    """A ``(batch, rows, rank)`` factor; ``Q`` factors are stored as ``Qᵀ`` (rank x rows).

    With ``Qᵀ`` contiguous, ``M Q``, ``Mᵀ P`` (computed as ``(Pᵀ M)ᵀ``) and ``P Qᵀ`` all read ``M``
    row by row; CPU BLAS is several times slower on an n x 2 right-hand side stored row-major.
    """
    if not is_q:
        return flat.view(shape)
    batch, rows, rank = shape
    return flat.view(batch, rank, rows).transpose(1, 2)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _compute_sent(call: _Call, send: torch.Tensor) -> None:
    """``P = M Q`` (or ``Q = Mᵀ P`` for a single-round Q step) into views of ``send``."""
    offset = 0
    for g in call.groups:
        shape = _sent_shape(g)
        g.sent = _factor_view(
            send[offset : offset + _numel(shape)], shape, is_q=g.entries[0].step == _Q_STEP
        )
        offset += _numel(shape)
        first = g.entries[0]
        if call.state.single_round and not g.stacked:
            # Its own numerics: take the fast kernels, fused with the error compensation.
            if first.step == _Q_STEP:
                lowrank.compensated_right_factor_into(
                    first.matrix, first.pending_error, g.known[0], g.sent[0].t()
                )
            else:
                lowrank.compensated_left_factor_into(
                    first.matrix, first.pending_error, g.known[0].t(), g.sent[0], call.scratch()
                )
            first.pending_error = None
        elif first.step == _Q_STEP:
            lowrank.right_factor_into(g.stack, g.known, g.sent)
        else:
            lowrank.left_factor_into(g.stack, g.known, g.sent, exact=not call.state.single_round)


def _all_finite(*tensors: torch.Tensor) -> bool:
    # Decided on reduced data, identical on every rank, so every rank takes the same branch.
    return all(t.numel() == 0 or bool(torch.isfinite(t).all()) for t in tensors)


def _undo_compensation(call: _Call) -> None:
    if not call.state.use_error_feedback:
        return
    for key, t in zip(call.uncompressed_keys, call.uncompressed):
        if key in call.state.error_dict:
            t.sub_(call.state.error_dict[key])
    for e in call.entries:
        if e.error_in_matrix:
            e.matrix.sub_(call.state.error_dict[e.key])


def _unpack_uncompressed(call: _Call, averaged: torch.Tensor, update: bool) -> None:
    """Copy the averages back; remember ``local - mean`` (error feedback, as PyTorch does)."""
    state, offset = call.state, 0
    remember = update and state.use_error_feedback
    for key, t in zip(call.uncompressed_keys, call.uncompressed):
        mean = averaged[offset : offset + t.numel()].view_as(t)
        offset += t.numel()
        if remember:
            error = state.error_dict.get(key)
            if error is None or error.shape != t.shape:
                error = state.error_dict[key] = torch.empty_like(t)
            torch.sub(t, mean, out=error)
        t.copy_(mean)


def _decompress(
    call: _Call,
    p_of: Callable[[_Group], torch.Tensor],
    q_of: Callable[[_Group], torch.Tensor],
    update: bool,
) -> None:
    """Write ``P Qᵀ`` into the gradients and, if ``update``, remember the new error."""
    state = call.state
    remember = update and state.use_error_feedback
    scratch = call.scratch()
    for g in call.groups:
        p, q = p_of(g), q_of(g)
        for i, e in enumerate(g.entries):
            error = None
            if remember:
                error = state.error_dict.get(e.key)
                if error is None or error.shape != e.matrix.shape:
                    error = state.error_dict[e.key] = torch.empty_like(e.matrix)
            # Q factors are stored as Qᵀ, so q[i].t() is the contiguous (rank, cols) matrix.
            lowrank.reconstruct_(g.stack[i], p[i], q[i].t(), error, scratch)
            if g.stacked:
                e.matrix.copy_(g.stack[i])
    if call.writeback is not None:
        call.writeback()


def _finish_step(call: _Call) -> None:
    """Per-step bookkeeping done in the hook thread, in bucket order."""
    call.state.maybe_increase_iter(call.bucket)


# -- two rounds: P then Q -----------------------------------------------------------------------
def _two_rounds(call: _Call) -> torch.futures.Future[torch.Tensor]:
    group = call.group
    issuer = comm.issuer_for(group)
    dtype, device = call.buffer.dtype, call.buffer.device
    # The uncompressed tensors need no compression work: start their allreduce first.
    packed = torch.empty(sum(t.numel() for t in call.uncompressed), dtype=dtype, device=device)
    _compensate_uncompressed(call)
    lowrank.pack_into(call.uncompressed, packed)
    plain = _sum_then_mean(packed, group) if packed.numel() else comm.completed(packed)
    _compensate_matrices(call)
    _form_groups(call)
    q_all = torch.empty(
        sum(_numel(_known_shape(g)) for g in call.groups), dtype=dtype, device=device
    )
    p_all = torch.empty(
        sum(_numel(_sent_shape(g)) for g in call.groups), dtype=dtype, device=device
    )
    _prepare_known_factors(call, q_all)
    _compute_sent(call, p_all)
    # P is orthogonalised after the sum, so it needs no division by the world size.
    p_done = comm.allreduce(p_all, group)
    both = torch.futures.collect_all([plain, p_done])
    outcome: dict[str, bool] = {}
    q_done = issuer.then(
        both, lambda futs: _second_round(call, futs, packed, p_all, q_all, outcome, issuer.group)
    )
    _finish_step(call)
    return q_done.then(lambda fut: _after_second_round(call, fut, q_all, outcome))


def _second_round(
    call: _Call,
    futs: list,
    packed: torch.Tensor,
    p_all: torch.Tensor,
    q_all: torch.Tensor,
    outcome: dict[str, bool],
    follow_up: dist.ProcessGroup,
) -> torch.futures.Future:
    for f in futs:
        f.value()  # re-raise a failed collective
    if not _all_finite(packed, p_all):
        # Some rank's gradient was inf/NaN: send the bucket as plain allreduce would and keep
        # the error memory and factors, so a loss scaler can skip the step and go on cleanly.
        outcome["fallback"] = True
        _undo_compensation(call)
        return comm.average(call.buffer, follow_up)
    _unpack_uncompressed(call, packed, update=True)
    _orthogonalize_all(call, p_all, _sent_shape, lambda g: False)
    for g in call.groups:
        # The new Q overwrites the starting one, in the buffer that is sent next.
        lowrank.right_factor_into(g.stack, g.sent, g.known)
    return comm.allreduce(q_all, follow_up)


def _sum_then_mean(packed: torch.Tensor, group: dist.ProcessGroup) -> torch.futures.Future:
    # PyTorch's order (sum, then divide) rather than DDP's, for the same numerics as its hook.
    world = group.size()
    return comm.allreduce(packed, group).then(lambda fut: fut.value().div_(world))


def _after_second_round(
    call: _Call, fut: torch.futures.Future, q_all: torch.Tensor, outcome: dict[str, bool]
) -> torch.Tensor:
    fut.value()
    if outcome.get("fallback"):
        return call.buffer
    q_all.div_(call.group.size())
    _decompress(call, p_of=lambda g: g.sent, q_of=lambda g: g.known, update=True)
    if call.state.warm_start:
        for g in call.groups:
            for i, e in enumerate(g.entries):
                call.state.q_memory_dict[e.key] = g.known[i]
    return call.buffer


# -- one round: P or Q, packed with the uncompressed tensors ------------------------------------
def _one_round(call: _Call) -> torch.futures.Future[torch.Tensor]:
    group = call.group
    dtype, device = call.buffer.dtype, call.buffer.device
    _compensate_uncompressed(call)
    _compensate_matrices(call, fuse=True)
    _form_groups(call)
    unc = sum(t.numel() for t in call.uncompressed)
    known = torch.empty(
        sum(_numel(_known_shape(g)) for g in call.groups), dtype=dtype, device=device
    )
    send = torch.empty(
        unc + sum(_numel(_sent_shape(g)) for g in call.groups), dtype=dtype, device=device
    )
    lowrank.pack_into(call.uncompressed, send[:unc])
    _prepare_known_factors(call, known)
    _compute_sent(call, send[unc:])
    done = comm.average(send, group)
    _finish_step(call)
    return done.then(lambda fut: _after_one_round(call, fut.value(), unc))


def _after_one_round(call: _Call, send: torch.Tensor, unc: int) -> torch.Tensor:
    state = call.state
    ok = _all_finite(send)
    _unpack_uncompressed(call, send[:unc], update=ok)
    # With a non-finite input the approximation is non-finite too, which a loss scaler sees;
    # the error memory and factors stay as they were.
    _decompress(
        call,
        p_of=lambda g: g.known if g.entries[0].step == _Q_STEP else g.sent,
        q_of=lambda g: g.sent if g.entries[0].step == _Q_STEP else g.known,
        update=ok,
    )
    if ok:
        for g in call.groups:
            q_step = g.entries[0].step == _Q_STEP
            p, q = (g.known, g.sent) if q_step else (g.sent, g.known)
            for i, e in enumerate(g.entries):
                state.p_memory_dict[e.key] = p[i].clone()
                state.q_memory_dict[e.key] = q[i].clone()
                state._last_step[e.key] = e.step
    return call.buffer


def _single_round_step(state: PowerSGDState, key: Key) -> str:
    """Alternate per matrix; a matrix with no ``P`` yet starts with a ``P`` step."""
    if key in state.p_memory_dict and state._last_step.get(key) == _P_STEP:
        return _Q_STEP
    return _P_STEP


def _run(call: _Call) -> torch.futures.Future[torch.Tensor]:
    return _one_round(call) if call.state.single_round else _two_rounds(call)


# ----------------------------------------------------------------------------------------------
# The hooks
# ----------------------------------------------------------------------------------------------
def _check_state(state: Any, owner: str) -> PowerSGDState:
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"{owner} needs a commhooks.PowerSGDState as its state, got {type(state).__name__}. "
            f"Register it as ddp_model.register_comm_hook(PowerSGDState(None, ...), {owner})."
        )
    return state


def powerSGD_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with each large gradient matrix compressed to rank-``r`` factors.

    Plain allreduce for the first ``state.start_powerSGD_iter`` steps. Then, per bucket: the
    uncompressed tensors (vectors, small matrices) are packed and their average started; each
    other gradient ``M`` (plus its remembered error) is approximated by ``P Qᵀ`` with one power
    iteration: ``P = M Q``, sum ``P``, orthogonalise, ``Q = Mᵀ P``, average ``Q``. The error
    ``M - P Qᵀ`` is remembered. With ``state.single_round``, one factor per step and one
    collective (see :class:`PowerSGDState`).

    Args:
        state: the :class:`PowerSGDState` with the options and memory.
        bucket: the gradient bucket DDP hands to the hook.
    """
    owner = "powerSGD_hook"
    state = _check_state(state, owner)
    buffer = float_buffer(bucket, owner)
    group = state._group(owner)
    params = bucket.parameters()
    ordinals = state._ordinals_of(params)
    if not state._compressing():
        state.maybe_increase_iter(bucket)
        return comm.average(buffer, group)
    grads = bucket.gradients()
    plan = state._plan(ordinals, grads)
    state._count(plan.numel_before, plan.numel_after, bucket)
    entries = []
    for i, ordinal, n, m, r in plan.compressed:
        step = _single_round_step(state, ordinal) if state.single_round else _BOTH
        entries.append(_Entry(ordinal, grads[i].view(n, m), r, step))
    call = _Call(
        state,
        bucket,
        buffer,
        group,
        entries,
        [grads[i] for i in plan.uncompressed],
        [ordinals[i] for i in plan.uncompressed],
    )
    return _run(call)


def batched_powerSGD_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket compressed as one zero-padded square matrix of rank-``r`` factors.

    Cheaper than :func:`powerSGD_hook` (one product per bucket) but far less accurate unless
    the rank is 1, since a flat bucket has no low-rank structure across layers. State is kept
    per bucket and reset (with a warning) when DDP rebuilds the bucket with other parameters.

    Args:
        state: the :class:`PowerSGDState` with the options and memory.
        bucket: the gradient bucket DDP hands to the hook.
    """
    owner = "batched_powerSGD_hook"
    state = _check_state(state, owner)
    buffer = float_buffer(bucket, owner)
    group = state._group(owner)
    ordinals = state._ordinals_of(bucket.parameters())
    if not state._compressing():
        state.maybe_increase_iter(bucket)
        return comm.average(buffer, group)
    key = f"bucket{bucket.index()}"
    state._check_layout(key, ordinals)
    length = buffer.numel()
    side = lowrank.square_side(length)
    rank = lowrank.effective_rank(side, side, state.matrix_approximation_rank)
    state._count(length, 2 * side * rank, bucket)
    # The bucket stays as it was until the result is written back: the error is added to the
    # padded copy, so a fallback to plain allreduce sends the untouched gradient.
    square = torch.zeros(side * side, dtype=buffer.dtype, device=buffer.device)
    square[:length].copy_(buffer)
    step = _single_round_step(state, key) if state.single_round else _BOTH
    entry = _Entry(key, square.view(side, side), rank, step)
    call = _Call(state, bucket, buffer, group, [entry], [])
    call.writeback = lambda: buffer.copy_(square[:length])
    return _run(call)
