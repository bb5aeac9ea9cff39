"""One command that checks every hook on one GPU and writes what it found to a JSON file.

On one GPU and in under 8 minutes (about 3 on an H100) it runs one section after another, each
in fresh rank processes with a time budget of its own (a section that raises or runs out of
time is recorded as failed, with its error, and the next one runs):

1. ``parity``: every hook against PyTorch's counterpart on a small MLP, as the tests promise
   (bitwise where they promise bits), under NCCL with one rank and two gloo ranks on the GPU;
2. ``init_forms``: every hook, a few steps each, after ``init_process_group("nccl")`` (lazy) and
   ``init_process_group("nccl", device_id=...)`` (eager);
3. ``many_buckets``: every hook on 330 buckets, each hook with a timeout of its own;
4. ``sync_audit``: the host's waits for the GPU in a step (its backward pass and optimizer step,
   after a warm-up) of every hook, counted through PyTorch's GPU trace: none with the defaults,
   finite or not (under ``torch.cuda.set_sync_debug_mode("error")``), and exactly one, the
   batched check, with ``on_nonfinite="repair"``;
5. ``step_time``: step time and peak memory against PyTorch's hooks on the 4 x 4096 MLP, with
   one bucket and with 25 MB buckets (``examples/gpu_step_time.py``'s measurement);
6. ``bandwidth``: the quantize passes' speed (``examples/quantize_passes.py``);
7. ``host_cost``: each hook's host time per step against PyTorch's on 96 tiny buckets (and
   PowerSGD's with one), on one NCCL rank (``examples/host_cost.py --backend nccl``).

It prints a table of the sections and of the goals (each met or missed) and writes everything
to ``--json`` (default ``gpu_check.json``). ``--device cpu`` runs every section's logic on the
CPU over gloo with tiny sizes, in under a minute, so the script is tested without a GPU; what needs
CUDA is recorded there as ``skipped: no CUDA``::

    python examples/gpu_check.py
    python examples/gpu_check.py --device cpu --json /tmp/check.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from commhooks.testing import RankError, describe, run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_parts as parts  # noqa: E402

SKIPPED = "skipped: no CUDA"
Result = dict[str, Any]


@dataclass(frozen=True)
class Settings:
    """What the sections run on, and how large: a GPU's sizes, or a CPU's (seconds)."""

    cuda: bool
    hang_layers: int  # a bucket per layer at the tiny cap (its weight and bias)
    step_argv: tuple[str, ...]  # gpu_step_time.py's sizes, without the bucket caps
    quantize_numel: int  # quantize_passes.py's bucket
    quantize_rounds: int
    per_hook_s: float  # how long one hook may take in the many-buckets section
    side_by_side: int  # hooks checked at once in the many-bucket and sync sections
    host_argv: tuple[str, ...]  # host_cost.py's backend and sizes


GPU = Settings(
    True, 330, ("--device", "cuda", "--rounds", "3"), 1 << 26, 20, 30, 4,
    ("--backend", "nccl", "--rounds", "8"),
)  # fmt: skip
CPU = Settings(
    False,
    100,
    ("--device", "cpu", "--width", "32", "--layers", "2", "--batch", "4", "--steps", "2",
     "--warmup", "2", "--rounds", "1"),
    1 << 16,
    2,
    30,
    1,
    ("--backend", "inline", "--layers", "8", "--steps", "2", "--warmup", "3", "--rounds", "2",
     "--only", "allreduce,fp16,int8"),
)  # fmt: skip


class Budget:
    """The seconds left to a section; every rank call it makes is bounded by them."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 1:
            raise TimeoutError("the section's time budget is spent")
        return remaining


def verdict_of(results: dict[str, Result]) -> str:
    """A section's verdict from its parts': failed if any failed, skipped if all were."""
    verdicts = [r.get("verdict", "fail") for r in results.values()]
    if any(v == "fail" for v in verdicts):
        return "fail"
    if verdicts and all(v.startswith("skipped") for v in verdicts):
        return verdicts[0]
    return "pass"


def on_ranks(
    fn: Callable[..., Any],
    world: int,
    backend: str,
    budget: Budget,
    *args: Any,
    fraction: float = 1.0,
    at_most: float = float("inf"),
) -> Any:
    """``run_on_ranks`` within ``fraction`` of the section's time left, and ``at_most`` seconds.

    Ranks that fail or hang, or a budget already spent, make a failed part, not an exception.
    """
    try:
        timeout = min(budget.left() * fraction, at_most)
        return run_on_ranks(fn, world, *args, timeout=timeout, backend=backend)
    except RankError as exc:
        return {"verdict": "fail", "error": str(exc)[-3000:]}
    except TimeoutError as exc:
        return {"verdict": "fail", "error": f"not run: {exc}"}


def per_hook(results: Any) -> Result:
    """A part made of rank 0's verdicts per hook, or the failure of the whole call."""
    if isinstance(results, dict):
        return results
    return {"verdict": verdict_of(results[0]), "hooks": results[0]}


# ---------------------------------------------------------------------------------------------
# The sections: each takes the settings and its budget and returns its parts' results
# ---------------------------------------------------------------------------------------------
def parity(settings: Settings, budget: Budget) -> dict[str, Result]:
    """Every hook against PyTorch's counterpart: NCCL on one rank, gloo on two sharing the GPU."""
    out: dict[str, Result] = {}
    for label, world, backend in (("nccl, 1 rank", 1, "nccl"), ("gloo, 2 ranks", 2, "gloo")):
        if backend == "nccl" and not settings.cuda:
            out[label] = {"verdict": SKIPPED}
            continue
        half = 0.5 if backend == "nccl" else 1.0  # half for the first part, so both run
        results = on_ranks(parts.parity_rank, world, backend, budget, settings.cuda, fraction=half)
        out[label] = per_hook(results)
    return out


def init_forms(settings: Settings, budget: Budget) -> dict[str, Result]:
    """Every hook after a lazy and an eager ``init_process_group`` (eager binds NCCL at once)."""
    out: dict[str, Result] = {}
    for form in ("lazy", "eager"):
        if form == "eager" and not settings.cuda:
            out[form] = {"verdict": SKIPPED}
            continue
        half = 0.5 if form == "lazy" else 1.0
        args = (settings.cuda, form)
        results = on_ranks(parts.init_form_rank, 1, "gloo", budget, *args, fraction=half)
        out[form] = per_hook(results)
    return out


def each_hook(names: list[str], settings: Settings, run: Callable[[str], Any]) -> dict[str, Result]:
    """``run(name)`` for every hook, each in processes of its own, several at once on a GPU.

    Starting a rank (importing torch, making a CUDA context and a communicator) takes seconds,
    more than what most of these checks run; side by side on one GPU they take a section's
    budget once instead of once per hook. Each call owns its store, so they cannot meet.
    """
    with ThreadPoolExecutor(max_workers=settings.side_by_side) as pool:
        found = dict(zip(names, pool.map(run, names)))
    return {name: r if isinstance(r, dict) else r[0] for name, r in found.items()}


def many_buckets(settings: Settings, budget: Budget) -> dict[str, Result]:
    """Every hook on hundreds of buckets, each in its own process with its own timeout."""
    backend = "nccl" if settings.cuda else "gloo"

    def run(name: str) -> Any:
        args = (settings.cuda, name, settings.hang_layers)
        return on_ranks(
            parts.many_buckets_rank, 1, backend, budget, *args, at_most=settings.per_hook_s
        )

    return each_hook(parts.hook_names(), settings, run)


def sync_audit(settings: Settings, budget: Budget) -> dict[str, Result]:
    """How often a step of each hook makes the host wait for the device (finite or not, and
    with the repair)."""
    if not settings.cuda:
        return {name: {"verdict": SKIPPED} for name in parts.AUDITED}

    def run(name: str) -> Any:
        return on_ranks(parts.sync_audit_rank, 1, "nccl", budget, name, at_most=30)

    return each_hook(list(parts.AUDITED), settings, run)


def step_time(settings: Settings, budget: Budget) -> dict[str, Result]:
    """gpu_step_time.py's figures with one bucket and with 25 MB buckets, each in one process."""
    backend = "nccl" if settings.cuda else "gloo"
    out: dict[str, Result] = {}
    for label, cap in parts.CAPS.items():
        argv = [*settings.step_argv, "--bucket-cap-mb", str(cap)]
        # Each bucket size gets half of what is left when it starts: a slow first one leaves
        # the second its share.
        half = 0.5 if label == "one bucket" else 1.0
        result = on_ranks(parts.step_time_rank, 1, backend, budget, argv, fraction=half)
        if isinstance(result, dict):
            out[label] = result
            continue
        rows = {key.split("/", 1)[1]: row for key, row in result[0].items()}
        failed = {
            k: r["error"] for k, r in rows.items() if "error" in r and k not in parts.MAY_FAIL
        }
        out[label] = {"verdict": "fail" if failed else "pass", "hooks": rows, "errors": failed}
    return out


def bandwidth(settings: Settings, budget: Budget) -> dict[str, Result]:
    """The quantize passes timed by examples/quantize_passes.py: its printed table, line by line.

    Its functions, where it has them, add their findings (see ``parts.quantize_functions``).
    """
    device = "cuda" if settings.cuda else "cpu"
    script = Path(__file__).resolve().parent / "quantize_passes.py"
    sizes = ["--numel", str(settings.quantize_numel), "--rounds", str(settings.quantize_rounds)]
    runs = {"timing": [sys.executable, str(script), "--device", device, *sizes]}
    out: dict[str, Result] = {}
    for label, cmd in runs.items():
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget.left())
        except subprocess.TimeoutExpired as exc:
            out[label] = {"verdict": "fail", "error": f"no answer within {exc.timeout:.0f} s"}
            continue
        lines = [line.rstrip() for line in proc.stdout.splitlines() if line.strip()]
        verdict = "pass" if proc.returncode == 0 else "fail"
        out[label] = {"verdict": verdict, "lines": lines, "stderr": proc.stderr[-2000:]}
    out.update(
        parts.quantize_functions(
            torch.device(device), settings.quantize_numel, settings.quantize_rounds
        )
    )
    return out


def host_cost(settings: Settings, budget: Budget) -> dict[str, Result]:
    """examples/host_cost.py's table, each row with its ratio to PyTorch's and its goal: on
    the GPU one NCCL rank; on a CPU the backend that completes collectives as NCCL does."""
    script = Path(__file__).resolve().parent / "host_cost.py"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "host_cost.json"
        cmd = [sys.executable, str(script), *settings.host_argv, "--json", str(path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget.left())
        except subprocess.TimeoutExpired as exc:
            return {"table": {"verdict": "fail", "error": f"no answer within {exc.timeout:.0f} s"}}
        rows = json.loads(path.read_text())["rows"] if path.exists() else []
    lines = [line.rstrip() for line in proc.stdout.splitlines() if line.strip()]
    found: Result = {"verdict": "pass", "rows": rows, "lines": lines, "stderr": proc.stderr[-2000:]}
    if proc.returncode != 0 or not rows:
        last = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}, no table"]
        found.update(verdict="fail", error=last[-1][:300])
    return {"table": found}


SECTIONS: dict[str, tuple[Callable[[Settings, Budget], dict[str, Result]], float]] = {
    "parity": (parity, 50),
    "init_forms": (init_forms, 30),
    "many_buckets": (many_buckets, 80),
    "sync_audit": (sync_audit, 40),
    "step_time": (step_time, 195),
    "bandwidth": (bandwidth, 30),
    "host_cost": (host_cost, 45),
}  # seconds each: 470 in all, within 8 minutes with the start


def run_section(name: str, settings: Settings, scale: float) -> Result:
    """One section's parts and verdict; a section that raises is recorded as failed."""
    fn, seconds = SECTIONS[name]
    start = time.monotonic()
    try:
        results = fn(settings, Budget(seconds * scale))
        section: Result = {"verdict": verdict_of(results), "parts": results}
    except Exception as exc:
        section = {"verdict": "fail", "error": describe(exc)}
    section["seconds"] = round(time.monotonic() - start, 1)
    return section


def print_table(sections: dict[str, Result], goals: list[Result]) -> None:
    print(f"{'section':14} {'verdict':18} {'seconds':>7}  parts")
    for name, section in sections.items():
        found = section.get("parts", {})
        summary = ", ".join(f"{part}: {r.get('verdict', 'fail')}" for part, r in found.items())
        summary = summary or section.get("error", "")
        print(f"{name:14} {section['verdict']:18} {section['seconds']:7.1f}  {summary[:150]}")
    print(f"\n{'goal':64} {'measured':>8} {'limit':>6}  verdict")
    for goal in goals:
        measured = goal["measured"]
        shown = f"{measured:8.3f}" if isinstance(measured, float) else f"{str(measured):>8}"
        limit = f"{goal['limit']:6.2f}" if goal["limit"] is not None else f"{'':6}"
        print(f"{goal['goal']:64} {shown} {limit}  {goal['verdict'][:100]}")
    tally = {kind: sum(g["verdict"].startswith(kind) for g in goals) for kind in ("met", "missed")}
    others = len(goals) - sum(tally.values())
    print(f"goals: {tally['met']} met, {tally['missed']} missed, {others} not comparable here")


def write_findings(
    path: str, settings: Settings, sections: dict[str, Result], seconds: float
) -> Result:
    """The sections so far, their goals and the machine, as JSON at ``path``; returns them."""
    found = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if settings.cuda else "CPU",
        "settings": asdict(settings),
        "seconds": round(seconds, 1),
        "sections": sections,
        "goals": parts.goals(sections),
    }
    with open(path, "w") as f:
        json.dump(found, f, indent=1, default=str)
    return found


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    found = "cuda" if torch.cuda.is_available() else "cpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=found)
    parser.add_argument("--json", default="gpu_check.json", help="where to write the findings")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"any of {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "--budget-scale", type=float, default=1.0, help="multiplies every section's time budget"
    )
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if not args.sections:
        parser.error(f"--sections names none; choose from {', '.join(SECTIONS)}")
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; pass --device cpu to check the script on the CPU")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = GPU if args.device == "cuda" else CPU
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    start = time.monotonic()
    sections: dict[str, Result] = {}
    for name in args.sections:
        print(f"-- {name}", flush=True)
        sections[name] = run_section(name, settings, args.budget_scale)
        print(f"   {sections[name]['verdict']} in {sections[name]['seconds']:.1f} s", flush=True)
        # Written after every section: a run stopped from outside keeps what it found so far.
        found = write_findings(args.json, settings, sections, time.monotonic() - start)
    print_table(sections, found["goals"])
    print(f"\nwritten to {args.json} ({found['seconds']:.0f} s in all)")
    return 0 if all(s["verdict"] != "fail" for s in sections.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
