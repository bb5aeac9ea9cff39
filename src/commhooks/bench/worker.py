"""One rank's training loop, in a process of its own for every hook.

The launcher starts it through :func:`commhooks.testing.run_on_ranks`, which has set up the
process group (inside the rank's network namespace when there is one); a hook that crashes or
hangs takes down only its own ranks. Under torchrun (:mod:`commhooks.bench.launched`) the same
loop runs every hook in turn in the launcher's processes, each on a process group of its own,
on the rank's device. Figures recorded (see :class:`RankResult`):

* step times: each whole optimizer step on the device's clock (:mod:`commhooks.bench.clock`:
  the host's on a CPU, CUDA events on a GPU, where the host also waits for the step's end),
  after ``warmup`` untimed steps, up to ``measured_steps``, the same for every hook (a hook
  that trains longer only records the losses of its later steps; the payload, wire and memory
  figures below leave them out too); and the host's own time to issue each step;
* losses: the training loss of every step with its time since the first step began (the
  held-out evaluation left out: it is not training time);
* payload: calls and bytes handed to each kind of collective during the timed steps, from
  :func:`commhooks.comm.observe_collectives` (PyTorch's own hooks call ``torch.distributed``
  directly: for them, its calls are counted too);
* wire: the counters of the rank's link around the timed steps, in a network namespace;
* peak memory: the peak resident set size (``ru_maxrss``) at the end of the measured steps
  minus the resident set just before the task is built, i.e. what the model, optimizer, data,
  hook state and communication buffers added at their peak; in a run with
  ``spec.live_memory`` the allocator keeps nothing large after a free
  (:mod:`commhooks.bench.footprint`), and the figure is what they hold live at their peak;
  in a process that runs several hooks the peak is reset before each;
* on a GPU, the device's peak allocated memory (``torch.cuda.max_memory_allocated``) over the
  hook's run, model and optimizer included;
* held-out loss of this rank's model after ``heldout_at`` steps.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commhooks import comm
from commhooks.bench import footprint, hookset
from commhooks.bench.clock import DeviceClock, HostClock, clock_for
from commhooks.bench.netns import link_counters
from commhooks.bench.records import RankResult, RunSpec
from commhooks.bench.tasks import Task, make_task, to_device

__all__ = ["Training", "build", "train_rank"]


@dataclass
class Training:
    """A rank's model, optimizer and hook, and what its steps recorded so far."""

    spec: RunSpec
    rank: int
    task: Task
    model: torch.nn.Module  # DistributedDataParallel, or the model sharded with FSDP2
    optimizer: torch.optim.Optimizer
    after_step: Callable[[], Any]
    group: Any = None  # the hook's process group; None: the default one
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    clock: DeviceClock = field(default_factory=HostClock)
    step_s: list[float] = field(default_factory=list)
    host_step_s: list[float] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)
    heldout_loss: float = float("nan")
    started: float = field(default_factory=time.perf_counter)

    def barrier(self) -> None:
        """Wait for every rank of the hook's group (untimed)."""
        cuda = self.device.type == "cuda"
        dist.barrier(group=self.group, device_ids=[self.device.index] if cuda else None)

    def step(self, step: int, timed: bool) -> None:
        """One optimizer step on this step's batch; recorded, and timed if ``timed``. After
        step ``heldout_at`` (counted from 1), the held-out loss, outside any timing."""
        batch = to_device(self.task.train_batch(self.rank, step), self.device)
        if self.spec.lockstep:
            self.barrier()  # untimed: every rank starts the step together
        start, mark = time.perf_counter(), self.clock.mark()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.task.loss(batch, self.model)
        torch.autograd.backward(loss)
        self.optimizer.step()
        self.after_step()
        host_end, end_mark = time.perf_counter(), self.clock.mark()
        device_s = self.clock.seconds(mark, end_mark)  # on a GPU: waits for the step's end
        if timed:
            self.step_s.append(device_s)
            self.host_step_s.append(host_end - start)
        self.losses.append([step, float(loss.detach()), time.perf_counter() - self.started])
        if step + 1 == self.spec.heldout_at:
            began = time.perf_counter()
            self.heldout_loss = self.task.heldout_loss(self.task.model, self.device)
            # The timeline is training time: a hook that trains past this step must not pay
            # for the evaluation in its time to allreduce's loss (allreduce stops here).
            self.started += time.perf_counter() - began


def _task(spec: RunSpec) -> Task:
    if spec.model is not None:
        from commhooks.bench.usermodel import task_from_factory

        return task_from_factory(spec.model, spec.seed, heldout_step=spec.heldout_at)
    return make_task(spec.task, seed=spec.seed, params=spec.params)


def build(
    spec: RunSpec, rank: int, group: Any = None, device: torch.device | None = None
) -> Training:
    """The model, optimizer and hook of ``spec`` on this rank, communicating on ``group``
    (``None``: the default process group), placed on ``device`` (``None``: the CPU)."""
    device = device or torch.device("cpu")
    task = _task(spec)
    task.model.to(device)
    model: torch.nn.Module = task.model
    if spec.fsdp:
        from commhooks.bench.sharding import attach_sharded  # imports FSDP2

        after_step = attach_sharded(model, spec.hook, spec.options)
    else:
        model = DistributedDataParallel(
            task.model,
            bucket_cap_mb=spec.bucket_cap_mb,
            process_group=group,
            device_ids=[device.index] if device.type == "cuda" else None,
        )
        after_step = hookset.attach(model, spec.hook, spec.options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    return Training(
        spec, rank, task, model, optimizer, after_step, group, device, clock_for(device)
    )


class _LinkTraffic:
    """The counters of the rank's link over a block: ``delta``, ``None`` on loopback."""

    def __init__(self, host_end: str | None) -> None:
        self.host_end = host_end
        self.delta: dict[str, int] | None = None
        self._before: dict[str, int] | None = None

    def __enter__(self) -> "_LinkTraffic":
        self._before = link_counters(self.host_end)
        return self

    def __exit__(self, *exc: object) -> None:
        after = link_counters(self.host_end)
        if self._before is not None and after is not None:
            self.delta = {k: after[k] - self._before[k] for k in after}


def train_rank(
    rank: int,
    world_size: int,
    spec: RunSpec,
    *,
    group: Any = None,
    device: torch.device | None = None,
    shared_process: bool = False,
) -> RankResult:
    """Train with ``spec.hook`` on this rank and measure it: on ``group`` (``None``: the
    default process group, which is set up), on ``device`` (``None``: the CPU);
    ``shared_process``: this process runs other hooks too (under torchrun), so its peak
    resident set is started afresh."""
    phases = {"start": time.time()}
    if spec.live_memory and not footprint.map_large_allocations_afresh():
        raise RuntimeError("live_memory needs glibc's allocator: run with --memory rss.")
    if shared_process:
        footprint.reset_peak_rss()  # an earlier hook's peak is not this one's
    rss_before = footprint.rss_bytes()
    clock = clock_for(device or torch.device("cpu"))
    clock.reset_peak_memory()
    run = build(spec, rank, group, device)
    phases["model"] = time.time()
    for step in range(spec.warmup):
        run.step(step, timed=False)
    run.barrier()
    host_end = spec.host_ends[rank] if spec.host_ends else None
    torch_calls = hookset.calls_torch_directly(spec.hook)
    with (
        comm.observe_collectives(torch_calls=torch_calls) as sent,
        _LinkTraffic(host_end) as link,
    ):
        for step in range(spec.warmup, spec.measured_end):
            run.step(step, timed=True)
        run.barrier()  # the last bytes have arrived before the counters are read
    peak_memory = max(0, footprint.peak_rss_bytes() - rss_before)
    device_peak = clock.peak_memory_bytes()
    for step in range(spec.measured_end, spec.steps):
        run.step(step, timed=False)  # only its loss (when it reaches allreduce's) is kept
    finish = getattr(run.after_step, "finish", None)
    if finish is not None:
        finish()  # a sync still in flight ends before the rank does (DiLoCo)
    phases["trained"] = time.time()
    return RankResult(
        rank=rank,
        step_s=run.step_s,
        host_step_s=run.host_step_s,
        device=str(run.device),
        device_peak_memory_bytes=device_peak,
        losses=run.losses,
        heldout_loss=run.heldout_loss,
        peak_memory_bytes=peak_memory,
        payload_calls=dict(sent.calls),
        payload_bytes=dict(sent.bytes),
        wire=link.delta,
        gradient_bytes=sum(p.numel() * p.element_size() for p in run.task.model.parameters()),
        task=run.task.describe,
        phases=phases,
    )
