"""What ``examples/gpu_check.py``'s rank processes run, and how its goals are judged.

Every ``*_rank`` function runs inside a rank started by ``commhooks.testing.run_on_ranks`` and
returns, per hook, a dict with a ``verdict`` ("pass", "fail" or "skipped: why") and what was
measured. Each compares what the test suite promises: bitwise where it promises bits.
"""

import contextlib
import io
import os
import re
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import gpu_step_time
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks as torch_debugging
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_local
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks import comm, config
from commhooks.testing import describe

Result = dict[str, Any]
Attach = Callable[[DDP], Any]
Data = list[tuple[torch.Tensor, torch.Tensor]]

IN, OUT, STEPS = 32, 8, 8
SMALL_BUCKETS = 0.004  # bucket_cap_mb: several buckets for the small MLP
ONE_BUCKET = 100.0
TINY_CAP = 0.0001  # below one parameter of Linear(8, 8): a bucket per parameter
FAST = {"start_powerSGD_iter": 2, "start_localSGD_iter": 2, "sync_every": 2}  # real work soon
# The sync audit: every hook's step with its defaults, and with on_nonfinite="repair" where it
# has the option; DiLoCo's hooks in their warm-up (no averager attached: each step is one).
AUDITED = {
    "allreduce": {}, "fp16": {}, "bf16": {}, "power_sgd": {}, "power_sgd_single_round": {},
    "batched_power_sgd": {}, "int8": {}, "int4": {}, "post_local_sgd": {},
    "diloco": {"sync_every": 2, "warmup_steps": 99, "warmup_bits": 8},
    "streaming_diloco": {"sync_every": 2, "warmup_steps": 99},
}  # fmt: skip
# Host waits a step: none with the defaults, finite or not; one with the repair (its check).
EXPECTED_WAITS = {"finite": 0, "non-finite": 0, "repair": 1, "repair, non-finite": 1}
CAPS = {"one bucket": 4096.0, "25 MB buckets": 25.0}
# Ours against PyTorch's counterpart, in gpu_step_time.py's names.
COUNTERPARTS = {
    "noop": "torch_noop",
    "allreduce": "torch_allreduce",
    "fp16": "torch_fp16",
    "bf16": "torch_bf16",
    "power_sgd": "torch_power_sgd",
    "power_sgd_single_round": "torch_power_sgd",
    "batched_power_sgd": "torch_batched_power_sgd",
    "post_local_sgd": "torch_post_local_sgd",
}
FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
TRACE = re.compile(r"torch[/\\](_utils|cuda[/\\]_gpu_trace)\.py$")  # the trace's own frames
MAY_FAIL = set(COUNTERPARTS.values())  # PyTorch's hook failing is a finding, not ours failing


def hook_names() -> list[str]:
    return config.hook_names()


def fast_options(name: str) -> dict[str, Any]:
    """Options of hook ``name`` that start its real work within a few steps."""
    return {k: v for k, v in FAST.items() if k in config.hook_spec(name).options}


def device_of(cuda: bool) -> torch.device:
    if not cuda:
        return torch.device("cpu")
    torch.cuda.set_device(0)  # every rank on the one GPU
    return torch.device("cuda", 0)


def mlp(widths: tuple[int, ...] = (IN, 64, 64, 32, OUT)) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def data(device: torch.device, steps: int = STEPS) -> Data:
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    return [
        (
            torch.randn(16, IN, generator=gen).to(device),
            torch.randn(16, OUT, generator=gen).to(device),
        )
        for _ in range(steps)
    ]


def wrap(model: nn.Module, device: torch.device, cap: float) -> DDP:
    ids = [device.index] if device.type == "cuda" else None
    return DDP(model.to(device), device_ids=ids, bucket_cap_mb=cap)


def train(ddp: DDP, batches: Data) -> torch.Tensor:
    """The averaged gradients of every step, one row per step, on the CPU."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    rows = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in ddp.parameters()]).cpu())
        opt.step()
    return torch.stack(rows)


def ours(name: str, **options: Any) -> Attach:
    return lambda ddp: commhooks.register(ddp, name, **options)


def theirs(hook: Callable[..., Any], state: Any = None) -> Attach:
    return lambda ddp: ddp.register_comm_hook(state, hook)


def grads(device: torch.device, batches: Data, attach: Attach | None, cap: float) -> Any:
    """Train a fresh MLP with ``attach``'s hook: its gradients per step, and the hook's state."""
    ddp = wrap(mlp(), device, cap)
    state = attach(ddp) if attach is not None else None
    return train(ddp, batches), state


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)).max())


def same_on_every_rank(t: torch.Tensor) -> bool:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, t)
    return all(torch.equal(other, t) for other in everyone)


# ---------------------------------------------------------------------------------------------
# Parity: every hook against its counterpart, as the tests promise
# ---------------------------------------------------------------------------------------------
class Case:
    """One rank's device, data, and the gradients of DDP without a hook on them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.batches = data(device)
        self.plain = grads(device, self.batches, None, SMALL_BUCKETS)[0]

    def run(self, attach: Attach | None, cap: float = SMALL_BUCKETS) -> Any:
        return grads(self.device, self.batches, attach, cap)


def bitwise(a: torch.Tensor, b: torch.Tensor, promise: str) -> Result:
    differing = int((a != b).sum())
    return {"verdict": "pass" if differing == 0 else "fail", "promise": promise,
            "differing_elements": differing}  # fmt: skip


def as_plain_ddp(name: str) -> Callable[[Case], Result]:
    def check(case: Case) -> Result:
        return bitwise(case.run(ours(name))[0], case.plain, "bitwise DDP without a hook")

    return check


def as_pytorch(
    name: str, hook: Callable[..., Any], cuda_only: bool = False
) -> Callable[[Case], Result]:
    def check(case: Case) -> Result:
        if cuda_only and case.device.type != "cuda":
            return {"verdict": "skipped: PyTorch's hook needs CUDA"}
        got, want = case.run(ours(name))[0], case.run(theirs(hook))[0]
        result = bitwise(got, want, "bitwise PyTorch's hook")
        if name in ("fp16", "bf16") and torch.equal(got, case.plain):
            result.update(verdict="fail", error="the precision was not reduced")
        return result

    return check


def post_local_sgd(case: Case) -> Result:
    options = {"start_localSGD_iter": 3, "post_local_gradient_allreduce": False}
    got = case.run(ours("post_local_sgd", **options))[0]
    state = torch_local.PostLocalSGDState(None, None, **options)
    want = case.run(theirs(torch_local.post_localSGD_hook, state))[0]
    return bitwise(got, want, "bitwise PyTorch's hook, before and after local SGD starts")


def power_sgd(case: Case) -> Result:
    """Within 1e-5 of PyTorch's hook, same seed, same compression: Gram-Schmidt with a warm
    start, QR without."""
    batches, worst, stats_equal = data(case.device, 20), 0.0, True
    for rank, warm in ((1, True), (3, False)):
        options = {"matrix_approximation_rank": rank, "start_powerSGD_iter": 2, "warm_start": warm}
        mine = commhooks.PowerSGDState(None, **options)
        ref = torch_powersgd.PowerSGDState(None, **options)
        got = grads(case.device, batches, theirs(commhooks.powerSGD_hook, mine), ONE_BUCKET)[0]
        want = grads(case.device, batches, theirs(torch_powersgd.powerSGD_hook, ref), ONE_BUCKET)[0]
        worst = max(worst, relative(got, want))
        stats_equal &= mine.compression_stats() == ref.compression_stats()
    ok = worst <= 1e-5 and stats_equal
    return {"verdict": "pass" if ok else "fail", "promise": "within 1e-5 of PyTorch's, same rates",
            "relative_error": worst, "same_compression_stats": stats_equal}  # fmt: skip


def replicas(name: str, bound: float | None = None) -> Callable[[Case], Result]:
    """No PyTorch counterpart: replicas identical and finite (and near plain DDP: ``bound``)."""

    def check(case: Case) -> Result:
        got, _ = case.run(ours(name, **fast_options(name)))
        error = relative(got, case.plain)
        ok = bool(torch.isfinite(got).all()) and same_on_every_rank(got)
        ok &= bound is None or error < bound
        promise = "replicas identical, finite" + (f", within {bound} of plain DDP" if bound else "")
        return {"verdict": "pass" if ok else "fail", "promise": promise, "relative_to_plain": error}

    return check


def diloco(name: str) -> Callable[[Case], Result]:
    """An averager, not a gradient hook: after training with syncs and ``finish()``, every
    rank holds the same finite global parameters."""

    def check(case: Case) -> Result:
        ddp = wrap(mlp(), case.device, SMALL_BUCKETS)
        averager = commhooks.register(ddp, name, **fast_options(name))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        averager.attach(opt, ddp.module.named_parameters())
        for x, y in case.batches:
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        averager.finish()
        shared = averager.state_dict()["snapshot"].values()
        params = torch.cat([t.reshape(-1).cpu() for t in shared])
        ok = bool(torch.isfinite(params).all()) and same_on_every_rank(params)
        promise = "every rank the same finite global parameters after finish()"
        return {"verdict": "pass" if ok else "fail", "promise": promise}

    return check


PARITY: dict[str, Callable[[Case], Result]] = {
    "no": as_plain_ddp("no"),
    "allreduce": as_plain_ddp("allreduce"),
    "noop": as_pytorch("noop", torch_debugging.noop_hook),
    "fp16": as_pytorch("fp16", torch_default.fp16_compress_hook),
    "bf16": as_pytorch("bf16", torch_default.bf16_compress_hook, cuda_only=True),
    "post_local_sgd": post_local_sgd,
    "power_sgd": power_sgd,
    "batched_power_sgd": replicas("batched_power_sgd"),  # PyTorch's fails in DDP
    "power_sgd_single_round": replicas("power_sgd_single_round"),
    "int8": replicas("int8", 0.1),  # the bounds of tests/test_cuda.py
    "int4": replicas("int4", 0.9),
    "diloco": diloco("diloco"),
    "streaming_diloco": diloco("streaming_diloco"),
}


def parity_rank(rank: int, world_size: int, cuda: bool) -> dict[str, Result]:
    case = Case(device_of(cuda))
    out: dict[str, Result] = {}
    for name in hook_names():
        check = PARITY.get(name)
        try:
            out[name] = check(case) if check else {"verdict": "fail", "error": "no check"}
        except Exception as exc:
            out[name] = {"verdict": "fail", "error": describe(exc)}
    return out


# ---------------------------------------------------------------------------------------------
# Both forms of init_process_group, many buckets, the sync audit, step time
# ---------------------------------------------------------------------------------------------
def init_form_rank(rank: int, world_size: int, cuda: bool, form: str) -> dict[str, Result]:
    """Every hook for a few steps after ``init_process_group`` in the ``form`` given."""
    dist.destroy_process_group()  # the one run_on_ranks made: this form replaces it
    device = device_of(cuda)
    eager = {"device_id": device} if form == "eager" else {}
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **eager)
    out: dict[str, Result] = {}
    for name in (n for n in hook_names() if n != "no"):
        try:
            got, _ = grads(device, data(device, 4), ours(name, **fast_options(name)), SMALL_BUCKETS)
            ok = bool(torch.isfinite(got).all()) and bool(got[-1].abs().sum() > 0)
            out[name] = {"verdict": "pass" if ok else "fail", "steps": len(got)}
        except Exception as exc:
            out[name] = {"verdict": "fail", "error": describe(exc)}
    return out


def chain(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers)))


def bucket_count(model: nn.Module, device: torch.device, cap: float) -> int:
    """How many buckets DDP makes of ``model`` at ``cap`` once it has rebuilt them."""
    ddp = wrap(model, device, cap)
    seen: set[int] = set()

    def count(_: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.add(bucket.index())
        return comm.completed(bucket.buffer())  # a future that knows the bucket's device

    ddp.register_comm_hook(None, count)
    for _ in range(2):
        seen.clear()
        ddp(torch.randn(2, 8, device=device)).sum().backward()
    return len(seen)


def many_buckets_rank(rank: int, world_size: int, cuda: bool, name: str, layers: int) -> Result:
    """Hook ``name`` for 4 steps of a model of ``layers`` layers, a bucket per parameter.

    On the CPU, collectives complete inline as NCCL's do (``comm.completing_inline``), so the
    hooks follow the GPU's path: callbacks run at once, follow-ups are held to the last bucket.
    """
    device = device_of(cuda)
    buckets = bucket_count(chain(layers), device, TINY_CAP)
    ddp = wrap(chain(layers), device, TINY_CAP)
    ours(name, **fast_options(name))(ddp)
    batches = [(torch.randn(4, 8, device=device), torch.randn(4, 8, device=device))] * 4
    with contextlib.nullcontext() if cuda else comm.completing_inline():
        got = train(ddp, batches)
    ok = bool(torch.isfinite(got).all()) and buckets >= layers
    return {"verdict": "pass" if ok else "fail", "buckets": buckets, "steps": len(got)}


def first_sync(exc: BaseException) -> str:
    """Where the sync was asked for: the deepest frame in commhooks, else the deepest frame.

    A hook's error reaches ``backward()`` through DDP's C++ reducer, with the hook's Python
    traceback in its message rather than in ``__traceback__``: both are searched.
    """
    frames = [
        f"{f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_tb(exc.__traceback__)
    ]
    frames += [f"{p}:{n} in {fn}" for p, n, fn in FRAME.findall(str(exc))]
    mine = [f for f in frames if "commhooks" in f and "examples" not in f]
    found = mine or frames
    return found[-1] if found else (str(exc).strip().splitlines() or ["?"])[0]


class HostWaits:
    """Counts the host's waits for the GPU through PyTorch's GPU trace (what its CUDA sanitizer
    uses): a stream synchronised (``.item()``, a blocking copy), an event waited for, the device
    synchronised. Sync debug mode "error" stops at the first; this counts them all, each kept as
    the line that asked. The trace stays on for the rest of the process, which is the audit's own.
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.active = False
        from torch.cuda import _gpu_trace

        torch._C._activate_gpu_trace()
        _gpu_trace.register_callback_for_event_synchronization(self._seen)
        _gpu_trace.register_callback_for_stream_synchronization(self._seen)
        _gpu_trace.register_callback_for_device_synchronization(self._seen)

    def _seen(self, *_: Any) -> None:
        if self.active:
            stack = traceback.extract_stack()[:-1]  # without this function
            frames = [
                f"{f.filename}:{f.lineno} in {f.name}"
                for f in stack
                if not TRACE.search(f.filename)
            ]
            mine = [f for f in frames if "commhooks" in f and "examples" not in f]
            self.lines.append((mine or frames or ["?"])[-1])

    @contextlib.contextmanager
    def counting(self) -> Iterator[list[str]]:
        self.lines, self.active = [], True
        try:
            yield self.lines
        finally:
            self.active = False


def audited_step(
    opt: torch.optim.Optimizer, loss: torch.Tensor, waits: HostWaits | None, expected: int
) -> Result:
    """The backward pass and the step, the host's waits counted; ``expected`` of them pass.

    Where none is expected, sync debug mode "error" also stops any synchronising call the trace
    does not report, at the line that made it.
    """
    cuda = loss.device.type == "cuda"  # on the CPU: the audit's own logic, nothing counted
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if expected == 0 else "default")
    try:
        with waits.counting() if waits else contextlib.nullcontext([]) as seen:
            loss.backward()
            opt.step()
    except RuntimeError as exc:
        return {"verdict": "fail", "syncs": ">= 1", "first_sync": first_sync(exc),
                "error": describe(exc)}  # fmt: skip
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    found: Result = {"syncs": len(seen), "lines": list(seen)}
    if waits is None:
        found["syncs"] = "not counted: " + ("no GPU trace" if cuda else "on the CPU")
    if len(seen) != expected and waits is not None:
        return {**found, "verdict": "fail", "error": f"{len(seen)} host waits, {expected} expected"}
    return {**found, "verdict": "pass"}


def _poisoning(param: torch.Tensor) -> dict[str, bool]:
    """While ``flag["now"]``, the gradient of ``param`` gets an ``inf`` (set on the device)."""
    flag = {"now": False}

    def inject(grad: torch.Tensor) -> torch.Tensor:
        if not flag["now"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[:1].fill_(float("inf"))
        return grad

    param.register_hook(inject)
    return flag


def _audit_cases(
    name: str, policy: str | None, waits: HostWaits | None, cuda: bool
) -> dict[str, Result]:
    """A finite and then a non-finite step of hook ``name`` after a warm-up, each audited."""
    device = device_of(cuda)
    width = 1024 if cuda else 64
    ddp = wrap(mlp((width,) * 5), device, 4 * width * width / 2**20)  # a bucket per layer
    extra = {} if policy is None else {"on_nonfinite": policy}
    ours(name, **{**fast_options(name), **AUDITED[name], **extra})(ddp)
    poison = _poisoning(next(ddp.module.parameters()))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = torch.randn(64, width, device=device), torch.randn(64, width, device=device)
    for _ in range(5):  # past DDP's bucket rebuild and PowerSGD's start
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    out: dict[str, Result] = {}
    for poisoned in (False, True):
        case = ("repair" if policy else "finite") if not poisoned else (
            "repair, non-finite" if policy else "non-finite")  # fmt: skip
        poison["now"] = poisoned
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        out[case] = audited_step(opt, loss, waits, EXPECTED_WAITS[case])
        finite = all(bool(torch.isfinite(p.grad).all()) for p in ddp.parameters())
        if finite == poisoned:
            out[case].update(verdict="fail", error=f"the step's finiteness was {finite}")
    return out


def sync_audit_rank(rank: int, world_size: int, name: str, cuda: bool = True) -> Result:
    """After a warm-up, how often a finite and a non-finite step of hook ``name`` make the host
    wait for the GPU: with its defaults, and with ``on_nonfinite="repair"`` where it has it.
    Without ``cuda`` the same steps run on the CPU, nothing counted (the audit's own test)."""
    waits: HostWaits | None = None
    with contextlib.suppress(AttributeError, ImportError):  # a PyTorch without the GPU trace
        waits = HostWaits() if cuda else None
    cases = _audit_cases(name, None, waits, cuda)
    if "repair" in audit_cases(name):
        cases.update(_audit_cases(name, "repair", waits, cuda))
    failed = any(c["verdict"] != "pass" for c in cases.values())
    return {"verdict": "fail" if failed else "pass", "cases": cases}


def step_time_rank(rank: int, world_size: int, argv: list[str]) -> dict[str, Result]:
    """gpu_step_time.py's figures for every hook, with ``argv`` as its command line."""
    args = gpu_step_time.parse_args(argv)
    if args.device == "cuda":  # as the script alone has: threads to build the 4 x 4096 MLP
        torch.set_num_threads(min(8, os.cpu_count() or 1))
    return gpu_step_time.measure(args, device_of(args.device == "cuda"))


def quantize_functions(device: torch.device, numel: int, rounds: int) -> dict[str, Result]:
    """What examples/quantize_passes.py's functions report, for those it defines.

    The hook points: ``check(device, block, numel) -> bool`` (the fused kernels give the eager
    form's bits) and ``bandwidth(device, numel, rounds) -> dict[str, float]`` (GB/s of each
    pass).
    """
    import quantize_passes

    out: dict[str, Result] = {}
    check = getattr(quantize_passes, "check", None)
    if check is not None:
        printed = io.StringIO()
        try:  # a part that raises fails alone: the timing beside it is kept
            with contextlib.redirect_stdout(printed):
                same = bool(check(device, 256, min(numel, 1 << 20)))
            found: Result = {"verdict": "pass" if same else "fail"}
        except Exception as exc:
            found = {"verdict": "fail", "error": describe(exc)}
        out["bit check"] = {**found, "lines": printed.getvalue().splitlines()}
    measure = getattr(quantize_passes, "bandwidth", None)
    if measure is not None:
        out["GB/s"] = {"verdict": "pass", "passes": dict(measure(device, numel, rounds))}
    return out


# ---------------------------------------------------------------------------------------------
# The goals: step time and memory against PyTorch's, int8/int4 against fp16, no syncs
# ---------------------------------------------------------------------------------------------
def ratio_goal(
    text: str, rows: dict[str, Result], pair: tuple[str, str], key: str, limit: float
) -> Result:
    """Goal ``text``: ``rows[ours][key] / rows[theirs][key]`` at most ``limit``."""
    ours_, theirs_ = (rows.get(name, {}) for name in pair)
    goal: Result = {"goal": text, "measured": None, "limit": limit}
    if key not in ours_:
        return {**goal, "verdict": f"missed: not measured ({ours_.get('error', 'no row')})"}
    if key not in theirs_ or theirs_[key] <= 0:
        why = theirs_.get("error", "nothing to compare on this device")
        return {**goal, "verdict": f"n/a: {pair[1]} {why}"[:200]}
    ratio = ours_[key] / theirs_[key]
    return {**goal, "measured": ratio, "verdict": "met" if ratio <= limit else "missed"}


def step_goals(label: str, part: Result) -> list[Result]:
    rows = part.get("hooks", {})
    if not rows:
        return [{"goal": f"step time, {label}", "measured": None, "limit": None,
                 "verdict": f"missed: {part.get('error', 'not measured')[:200]}"}]  # fmt: skip
    goals = []
    for mine, ref in COUNTERPARTS.items():
        pair = (mine, ref)
        goals.append(ratio_goal(f"{label}: step time {mine} / {ref}", rows, pair, "median_ms", 1.0))
        goals.append(
            ratio_goal(f"{label}: peak memory {mine} / {ref}", rows, pair, "peak_mib", 1.05)
        )
    for mine in ("int8", "int4"):
        pair = (mine, "fp16")
        goals.append(ratio_goal(f"{label}: step time {mine} / fp16", rows, pair, "median_ms", 1.0))
    return goals


def audit_cases(name: str) -> list[str]:
    """The steps audited for hook ``name``: the repair's too where it has the option."""
    repairs = "on_nonfinite" in config.hook_spec(name).options
    return [case for case in EXPECTED_WAITS if repairs or not case.startswith("repair")]


def sync_goals(section: Result) -> list[Result]:
    """One goal a hook and case: its host waits in a step against those expected."""
    found = section.get("parts", {})
    goals = []
    for name in AUDITED:
        part = found.get(name, {"verdict": f"fail: {section.get('error', 'not run')}"})
        for case in audit_cases(name):
            result = part.get("cases", {}).get(case, part)
            verdict = result["verdict"]
            met = (
                "met" if verdict == "pass" else "missed" if verdict.startswith("fail") else verdict
            )
            where = f" (first: {result['first_sync']})" if "first_sync" in result else ""
            goals.append({"goal": f"host waits in a step: {name}, {case}{where}",
                          "measured": result.get("syncs"),
                          "limit": float(EXPECTED_WAITS[case]), "verdict": met})  # fmt: skip
    return goals


def host_goals(section: Result) -> list[Result]:
    """Each row of host_cost.py's table as a goal: its ratio to PyTorch's against its limit."""
    table = section.get("parts", {}).get("table", {})
    rows = table.get("rows", [])
    if not rows:
        why = table.get("error") or section.get("error") or "not measured"
        return [{"goal": "host time per step", "measured": None, "limit": None,
                 "verdict": f"missed: {why}"[:200]}]  # fmt: skip
    return [
        {
            "goal": f"host time {r['hook']} / {r['against']}, {r['buckets']} bucket"
            + ("" if r["buckets"] == 1 else "s"),
            "measured": r["ratio"],
            "limit": r["goal"],
            "verdict": "met" if r["met"] else "missed",
        }
        for r in rows
    ]


def goals(sections: dict[str, Result]) -> list[Result]:
    """Every goal with its verdict: met, missed (and why), or n/a or skipped (and why)."""
    out: list[Result] = []
    if "step_time" in sections:
        found = sections["step_time"].get("parts", {})
        for label in CAPS:
            out += step_goals(label, found.get(label, sections["step_time"]))
    if "sync_audit" in sections:
        out += sync_goals(sections["sync_audit"])
    if "host_cost" in sections:
        out += host_goals(sections["host_cost"])
    return out
