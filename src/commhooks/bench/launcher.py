"""Start the ranks of one hook as fresh processes, wait for them, gather their figures.

Each hook gets new processes: state, memory and a crash are its own. They are forked from a
server that has already imported torch (an interpreter start with torch costs seconds per rank
per hook on a small machine); with a private network each child moves itself into its rank's
namespace before touching the network. Ranks rendezvous
through a file store in a private directory (no port to pick or race for), so the only
traffic on the benchmark link is the hooks' own. A rank that fails makes the others be killed
after a short grace period (they would wait in a collective forever), and the failure comes
back as a result with ``ok: false`` and the error, never as an exception.
"""

import json
import multiprocessing
import os
import tempfile
import time
from typing import Any

from commhooks.bench.worker import rank_entry

__all__ = ["run_hook", "start_server"]

_GRACE_S = 10.0


_PRELOAD = [
    "torch",
    "torch._dynamo",  # DDP imports it on construction: seconds, paid once here
    "torch.distributed",
    "torch.nn.parallel",
]  # not commhooks: each child imports it from the parent's sys.path (a checkout, a venv...)


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start_server() -> None:
    """Start the fork server now (it imports torch: seconds), not inside the first hook's run."""
    proc = _context().Process(target=os.getpid)  # returns once the server has forked it
    proc.start()
    proc.join()


def run_hook(spec: dict[str, Any], network: Any = None, timeout: float = 600.0) -> dict[str, Any]:
    """Run ``spec`` on ``spec["world_size"]`` ranks, inside ``network`` when given.

    Returns:
        ``{"ok": True, "ranks": [per-rank figures]}`` or ``{"ok": False, "error": ...,
        "ranks": [what arrived]}``.
    """
    world = spec["world_size"]
    with tempfile.TemporaryDirectory(prefix="commhooks-bench-") as tmp:
        os.chmod(tmp, 0o755)
        spec = {**spec, "store": os.path.join(tmp, "store"), "out": tmp}
        if network is not None:
            spec["namespaces"], spec["host_ends"] = network.namespaces, network.host_ends
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        ctx = _context()
        procs = []
        for rank in range(world):
            env = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
            if network is not None:
                env.update(network.env(rank))
            log = os.path.join(tmp, f"rank{rank}.log")
            procs.append(ctx.Process(target=rank_entry, args=(spec_path, rank, log, env)))
        for proc in procs:
            proc.start()
        try:
            failure = _wait(procs, timeout)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(10)
        ranks = [_read(tmp, r) for r in range(world)]
        errors = [r["error"] for r in ranks if r and not r.get("ok")]
        if failure is None and not errors and all(ranks):
            return {"ok": True, "ranks": ranks}
        error = errors[0] if errors else failure or "a rank exited without a result"
        if not errors and failure and "exit code" in failure:
            error = f"{failure}: {_last_line(tmp, world)}"
        return {"ok": False, "error": error, "ranks": [r for r in ranks if r], "log": _tail(tmp)}


def _wait(procs: list, timeout: float) -> str | None:
    """None when every rank exited 0; otherwise what went wrong first."""
    deadline = time.monotonic() + timeout
    failed_at = None
    failure = None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        bad = [p for p in procs if p.exitcode not in (None, 0)]
        if bad and failed_at is None:
            failed_at = now
            failure = f"rank {procs.index(bad[0])} exited with exit code {bad[0].exitcode}"
        if failed_at is not None and now - failed_at > _GRACE_S:
            return failure
        if now > deadline:
            return f"timed out after {timeout:.0f}s"
        time.sleep(0.05)
    bad = [p for p in procs if p.exitcode != 0]
    if bad:
        return f"rank {procs.index(bad[0])} exited with exit code {bad[0].exitcode}"
    return None


def _read(tmp: str, rank: int) -> dict | None:
    try:
        with open(os.path.join(tmp, f"rank{rank}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _tail(tmp: str, chars: int = 2000) -> str:
    parts = []
    for name in sorted(os.listdir(tmp)):
        if name.endswith(".log"):
            with open(os.path.join(tmp, name), errors="replace") as f:
                parts.append(f"--- {name} ---\n{f.read()[-chars:]}")
    return "\n".join(parts)


def _last_line(tmp: str, world: int) -> str:
    for rank in range(world):
        try:
            with open(os.path.join(tmp, f"rank{rank}.log"), errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            continue
        if lines:
            return lines[-1][:300]
    return "no output"
