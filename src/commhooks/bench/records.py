"""What crosses the process boundary of a bench run: what a rank is to do, what it measured.

The launcher hands each rank a :class:`RunSpec` and gets a :class:`RankResult` back from each;
both are plain dataclasses of numbers, strings, lists and dicts, so they pickle between
processes and round-trip through JSON (``to_dict``/``from_dict``) for the report and for
anyone reading a saved run.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar, cast

__all__ = ["RankResult", "Record", "RunOutcome", "RunSpec"]

RecordT = TypeVar("RecordT", bound="Record")


class Record:
    """Base of a dataclass of JSON values: ``from_dict(r.to_dict()) == r``."""

    def to_dict(self) -> dict[str, Any]:
        """Every field, as JSON values."""
        out: dict[str, Any] = dataclasses.asdict(cast(Any, self))  # subclasses are dataclasses
        return out

    @classmethod
    def from_dict(cls: type[RecordT], data: Mapping[str, Any]) -> RecordT:
        """Build from :meth:`to_dict`'s output; unknown keys are refused, missing ones defaulted.

        Raises:
            ValueError: a key that is not a field, or a required field that is missing.
        """
        names = {f.name for f in dataclasses.fields(cast(Any, cls))}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)}.")
        try:
            return cls(**dict(data))
        except TypeError as exc:  # a required field is missing
            raise ValueError(f"{cls.__name__}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class RunSpec(Record):
    """One hook's run, the same on every rank.

    Attributes:
        hook: the hook's bench name (``power_sgd``, ``torch_fp16``, ``floor_wire``...).
        options: the options its state is built with.
        task, params, seed: what is trained (see ``bench.tasks``).
        steps, warmup: steps run, and how many of the first are left out of the timing.
        measured_steps: timing, bytes and peak memory are measured up to this step (counted
            from 1) and no further, the same for every hook, so that rows compare like with
            like; a hook that trains longer (to show when it reaches ``allreduce``'s loss) only
            records the losses of its later steps. ``None``: up to ``steps``.
        heldout_at: the held-out loss is taken after this many steps (the same for every
            hook, whatever its ``steps``), so that it compares hooks at equal training.
        lr: AdamW's learning rate.
        bucket_cap_mb: DDP's bucket size.
        lockstep: start every step on all ranks together (an untimed barrier).
        host_ends: per rank, the host end of its link when it runs in a network namespace,
            whose counters give the bytes really sent; ``None`` on loopback.
        fsdp: shard the model with FSDP2 and run the hook through ``commhooks.fsdp``.
        live_memory: a run for the peak memory only: glibc maps every allocation of 64 KiB or
            more afresh from before the task is built, so that the peak resident set is what
            the steps hold live (``bench.footprint``); its steps are slower for it.
        model: ``package.module:factory`` of the user's model (``--model``), trained instead
            of ``task`` when given (``bench.usermodel``).
    """

    hook: str
    options: dict[str, Any]
    task: str
    params: int
    seed: int
    steps: int
    warmup: int
    heldout_at: int
    lr: float
    bucket_cap_mb: float
    lockstep: bool = False
    host_ends: list[str] | None = None
    fsdp: bool = False
    measured_steps: int | None = None
    live_memory: bool = False
    model: str | None = None

    @property
    def measured_end(self) -> int:
        """The step (counted from 0) at which measuring stops."""
        return self.steps if self.measured_steps is None else min(self.steps, self.measured_steps)


@dataclasses.dataclass
class RankResult(Record):
    """What one rank measured.

    Attributes:
        rank: the rank.
        step_s: seconds of each timed step (zero_grad, forward, backward with the hook's
            communication, optimizer step, model averaging) on the device's clock: the
            host's on a CPU, CUDA events on a GPU.
        host_step_s: seconds the host took to issue each timed step (on a CPU, where the host
            does the work, about ``step_s``; on a GPU what Python and launching cost).
        device: the device the rank trained on (``cpu``, ``cuda:0``...).
        device_peak_memory_bytes: on a GPU, ``torch.cuda.max_memory_allocated`` over the
            hook's run (model and optimizer included); ``None`` on a CPU.
        losses: per step, ``[step, training loss, seconds from the first step's start to this
            step's end]``.
        heldout_loss: the held-out loss of this rank's model after ``heldout_at`` steps.
        peak_memory_bytes: peak resident set minus the resident set before the task was built
            (what the steps held live at their peak in a run with ``live_memory``).
        payload_calls, payload_bytes: per collective kind, over the timed steps: calls, and
            bytes handed over (``commhooks.comm.observe_collectives``).
        wire: the link's counters over the timed steps (``tx_bytes``, ``tx_packets``,
            ``rx_bytes``, ``rx_packets``); ``None`` on loopback.
        gradient_bytes: the size of the model's gradients.
        task: the task's description.
        phases: wall-clock times at which the rank reached each phase.
    """

    rank: int
    step_s: list[float]
    losses: list[list[float]]
    heldout_loss: float
    peak_memory_bytes: int
    payload_calls: dict[str, int]
    payload_bytes: dict[str, int]
    wire: dict[str, int] | None
    gradient_bytes: int
    task: dict[str, Any] = dataclasses.field(default_factory=dict)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    host_step_s: list[float] = dataclasses.field(default_factory=list)
    device: str = "cpu"
    device_peak_memory_bytes: int | None = None

    @property
    def timed_steps(self) -> int:
        """How many steps were timed."""
        return len(self.step_s)


@dataclasses.dataclass
class RunOutcome(Record):
    """One hook's run on every rank, as the launcher got it back.

    Attributes:
        ok: every rank finished.
        ranks: each rank's result (empty when the run failed).
        error: one line saying what failed first.
        log: the failing rank's traceback or the tail of its output.
        repeats: how many runs were pooled into this one (``--repeat``).
    """

    ok: bool
    ranks: list[RankResult] = dataclasses.field(default_factory=list)
    error: str | None = None
    log: str = ""
    repeats: int = 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunOutcome":
        """Build from :meth:`to_dict`'s output, ranks included."""
        ranks = [RankResult.from_dict(r) for r in data.get("ranks", [])]
        return super().from_dict({**data, "ranks": ranks})
