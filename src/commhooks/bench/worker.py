"""One rank's training loop, in a process of its own for every hook.

The launcher forks it from a server that has imported torch (or runs
``python -m commhooks.bench.worker SPEC.json RANK``); a hook that crashes or hangs takes down
only its own ranks. The rank reads the run from a JSON spec and writes its raw figures to
``<out>/rank<R>.json``. Figures recorded:

* step times: wall-clock of each whole optimizer step (zero_grad, forward, backward with the
  hook's communication, optimizer step, model averaging), after ``warmup`` untimed steps;
* losses: the training loss of every step with its time since the first step;
* payload: bytes handed to each kind of collective during the timed steps, counted by wrapping
  ``torch.distributed``'s collective functions in this process (hooks, ours and PyTorch's,
  call them through the module attribute, so the wrapper sees every call);
* wire: the counters of the rank's link around the timed steps, when it runs in its own
  network namespace: sent bytes and packets from the rate limiter (``tc -s qdisc``), which
  counts each wire-sized segment with its headers, received ones at the link's host end;
* peak memory: the peak resident set size (``ru_maxrss``) minus the resident set just before
  the task is built, i.e. what the model, optimizer, data, hook state and communication buffers
  added at their peak;
* held-out loss of this rank's model after the last step.
"""

import datetime
import json
import os
import resource
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

__all__ = ["main", "run_rank"]

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "broadcast",
    "reduce_scatter_tensor",
    "all_to_all_single",
)
# Collectives whose first argument is the output: what this rank contributes comes second.
_OUTPUT_FIRST = ("all_gather", "all_gather_into_tensor", "all_gather_single")


class PayloadCounter:
    """Counts calls and tensor bytes of each collective while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._inside_exchange = threading.local()

    def install(self, dist: Any) -> None:
        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, original))
        from commhooks import comm

        comm._exchange_and_add = self._wrap_exchange(comm._exchange_and_add)
        comm._exchange_halves = self._wrap_exchange(comm._exchange_halves)
        comm._trade_sums = self._wrap_uncounted(comm._trade_sums)

    def _count(self, name: str, tensor: Any) -> None:
        if not self.active or getattr(self._inside_exchange, "on", False):
            return
        size = tensor.numel() * tensor.element_size() if hasattr(tensor, "numel") else 0
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.bytes[name] = self.bytes.get(name, 0) + size

    def _wrap(self, name: str, original: Any) -> Any:
        def counted(tensor_or_list: Any, *args: Any, **kwargs: Any) -> Any:
            self._count(name, args[0] if name in _OUTPUT_FIRST and args else tensor_or_list)
            return original(tensor_or_list, *args, **kwargs)

        return counted

    def _wrap_exchange(self, original: Any) -> Any:
        # commhooks sums some tensors of two gloo ranks by exchanging them (see
        # comm.allreduce): each such sum is counted as the allreduce it stands for, the
        # collective the same hook issues at other world sizes, so that predictions for them hold.
        def counted(tensor: Any, *args: Any) -> Any:
            self._count("all_reduce", tensor)
            return self._uncounted(original, tensor, *args)

        return counted

    def _wrap_uncounted(self, original: Any) -> Any:
        # The follow-up of an exchange counted above, on whichever thread runs it.
        return lambda *args: self._uncounted(original, *args)

    def _uncounted(self, original: Any, *args: Any) -> Any:
        before = getattr(self._inside_exchange, "on", False)  # a follow-up may run inline
        self._inside_exchange.on = True
        try:
            return original(*args)
        finally:
            self._inside_exchange.on = before


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _counters(host_end: str | None) -> dict[str, int] | None:
    """The rank's tx/rx counters around the timed steps, in bytes and wire-sized packets.

    Sent traffic is read from the rate limiter on the rank's own link, which counts every
    segment that goes on the wire with its headers, whether or not TCP handed it over as one
    offloaded packet. Received traffic is what the host end of the link delivered to the rank
    (its transmit counters). Without ``tc`` statistics both come from the host end.
    """
    if not host_end:
        return None
    base = f"/sys/class/net/{host_end}/statistics/"

    def host_end_count(name: str) -> int:
        with open(f"{base}{name}") as f:
            return int(f.read())

    sent = _limiter_counts()
    if sent is None:  # what the host end received is what the rank sent
        sent = (host_end_count("rx_bytes"), host_end_count("rx_packets"))
    return {
        "tx_bytes": sent[0],
        "tx_packets": sent[1],
        "rx_bytes": host_end_count("tx_bytes"),
        "rx_packets": host_end_count("tx_packets"),
    }


def _limiter_counts() -> tuple[int, int] | None:
    """Bytes and packets through the root qdisc of this namespace's link, if ``tc`` says."""
    from commhooks.bench.netns import IFACE

    try:
        done = subprocess.run(
            ["tc", "-s", "-j", "qdisc", "show", "dev", IFACE],
            capture_output=True,
            text=True,
            timeout=30,
        )
        qdiscs = json.loads(done.stdout) if done.returncode == 0 else []
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    for q in qdiscs:
        if q.get("root") and "bytes" in q and "packets" in q:
            return int(q["bytes"]), int(q["packets"])
    return None


def enter_namespace(name: str) -> None:
    """Move this (single-threaded, freshly forked) process into network namespace ``name``."""
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name} failed")
    finally:
        os.close(fd)


def run_rank(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    """Train with ``spec["hook"]`` on this rank and return the raw figures."""
    phases = {"start": time.time()}
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commhooks.bench import hookset
    from commhooks.bench.tasks import make_task

    torch.set_num_threads(spec.get("threads", 1))
    counter = PayloadCounter()
    counter.install(dist)
    world = spec["world_size"]
    dist.init_process_group(
        "gloo",
        init_method=f"file://{spec['store']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=spec.get("pg_timeout", 120)),
    )
    phases["process_group"] = time.time()
    rss_before = _rss_bytes()
    task = make_task(spec["task"], seed=spec["seed"], params=spec["params"])
    if spec.get("fsdp"):
        from commhooks.bench.sharding import attach_sharded

        model = task.model
        after_step = attach_sharded(model, spec["hook"], spec["options"])
    else:
        model = DDP(task.model, bucket_cap_mb=spec["bucket_cap_mb"])
        after_step = hookset.attach(model, spec["hook"], spec["options"])
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    phases["model"] = time.time()

    steps, warmup, iface = (
        spec["steps"],
        spec["warmup"],
        spec.get("host_ends", [None] * world)[rank],
    )
    step_s: list[float] = []
    losses: list[list[float]] = []
    wire_start = None
    t0 = time.perf_counter()
    for step in range(steps):
        if step == warmup:
            dist.barrier()
            wire_start, counter.active = _counters(iface), True
        batch = task.train_batch(rank, step)
        if spec.get("lockstep"):
            dist.barrier()  # untimed: every rank starts the step together
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = task.loss(batch, model)
        torch.autograd.backward(loss)
        opt.step()
        after_step()
        end = time.perf_counter()
        if step >= warmup:
            step_s.append(end - start)
        losses.append([step, float(loss.detach()), end - t0])
    counter.active = False
    dist.barrier()
    wire_end = _counters(iface)
    phases["trained"] = time.time()
    heldout = task.heldout_loss(task.model)
    phases["evaluated"] = time.time()
    wire = None
    if wire_start is not None and wire_end is not None:
        wire = {k: wire_end[k] - wire_start[k] for k in wire_end}
    return {
        "ok": True,
        "rank": rank,
        "step_s": step_s,
        "losses": losses,
        "heldout_loss": heldout,
        "phases": phases,
        "peak_memory_bytes": max(0, _peak_rss_bytes() - rss_before),
        "payload_calls": counter.calls,
        "payload_bytes": counter.bytes,
        "timed_steps": len(step_s),
        "wire": wire,
        "task": task.describe,
        "gradient_bytes": sum(p.numel() * p.element_size() for p in task.model.parameters()),
    }


def _describe(exc: BaseException) -> str:
    """One line: type and message, and where it was raised when the message is empty."""
    text = str(exc).strip().splitlines()
    if text:
        return f"{type(exc).__name__}: {text[0]}"[:500]
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    last = frames[-1]
    where = f"{os.path.basename(last.filename)}:{last.lineno}"
    return f"{type(exc).__name__} (raised in {last.name}, {where})"


def rank_entry(spec_path: str, rank: int, log_path: str, env: dict[str, str]) -> None:
    """Entry point of a forked rank: output to ``log_path``, namespace, environment, run."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    main([spec_path, str(rank)])


def main(argv: list[str] | None = None) -> None:
    """Entry point of a rank process: run, write ``rank<R>.json``, exit 0 or 1."""
    spec_path, rank_text = (argv or sys.argv[1:])[:2]
    rank = int(rank_text)
    with open(spec_path) as f:
        spec = json.load(f)
    out = os.path.join(spec["out"], f"rank{rank}.json")
    try:
        namespaces = spec.get("namespaces")
        if namespaces:
            enter_namespace(namespaces[rank])
        result = run_rank(spec, rank)
    except BaseException as exc:  # every failure becomes a result the report can show
        result = {
            "ok": False,
            "rank": rank,
            "error": _describe(exc),
            "traceback": traceback.format_exc()[-4000:],
        }
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    sys.stdout.flush()
    # Skip interpreter teardown: a peer may be stuck in a collective this rank will never join.
    os._exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
