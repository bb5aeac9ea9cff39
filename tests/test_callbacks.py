"""Callbacks on futures: torch's semantics, tracked until released, and a clean exit."""

import ast
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from ddp_utils import free_port

from commhooks import comm

ROOT = Path(__file__).resolve().parents[1]

# Each rank completes a collective while this thread holds the GIL (a switch interval of 100 s:
# the worker thread cannot take it), so the callback is still pending when the script ends.
# Without the wait at exit, the worker thread is ended inside the callback and the process
# aborts (with `then`, on every run seen; with `when_done`, in about half of them).
RANK_SCRIPT = """
import os, sys
import torch, torch.distributed as dist
from commhooks import comm
dist.init_process_group("gloo")
sys.setswitchinterval(100.0)
tensor = torch.ones(1 << 16)
parent = dist.all_reduce(tensor, async_op=True).get_future()
if os.environ["HOW"] == "then":
    child = comm.then(parent, lambda f: f.value()[0].sum().item())
else:
    comm.when_done(parent, lambda f: f.value()[0].sum().item())
while not parent.done():
    pass
print("ending with callbacks held:", comm.callbacks_held(), flush=True)
"""


def test_then_passes_values_and_errors_on_like_torch():
    fut: torch.futures.Future[int] = torch.futures.Future()
    doubled = comm.then(fut, lambda f: f.value() * 2)
    fut.set_result(21)
    assert doubled.wait() == 42

    failing: torch.futures.Future[int] = torch.futures.Future()
    ours = comm.then(failing, lambda f: f.value() + 1)
    torchs = failing.then(lambda f: f.value() + 1)  # the oracle
    failing.set_exception(ValueError("peer gone"))
    raised = []
    for after in (ours, torchs):
        with pytest.raises(Exception, match="peer gone") as info:
            after.wait()
        raised.append(info.type)
    assert raised[0] is raised[1]


def test_when_done_runs_once_and_callbacks_are_released_after_running():
    before = comm.callbacks_held()
    fut: torch.futures.Future[str] = torch.futures.Future()
    seen: list[str] = []
    comm.when_done(fut, lambda f: seen.append(f.value()))
    comm.then(fut, lambda f: None)
    assert comm.callbacks_held() == before + 2
    fut.set_result("done")
    assert seen == ["done"]
    assert comm.callbacks_held() == before


def test_released_callbacks_leave_the_registry_with_their_futures():
    """A released callback's entry goes, and with it the registry's hold on its future (whose
    result may be a gradient bucket): a long run keeps no entry per callback."""
    before = comm.callbacks_held()
    for _ in range(20):
        futures: list[torch.futures.Future[int]] = [torch.futures.Future() for _ in range(500)]
        for fut in futures:
            comm.then(fut, lambda f: f.value() + 1)
        for fut in futures:
            fut.set_result(1)
    assert comm.callbacks_held() == before
    assert len(comm._registry.entries) == before
    kept = torch.futures.Future()
    alive = weakref.ref(kept)
    comm.then(kept, lambda f: f.value())
    kept.set_result(torch.zeros(1))
    del kept
    assert alive() is None


def test_a_callback_on_a_completed_future_runs_at_once_and_is_not_held():
    before = comm.callbacks_held()
    fut: torch.futures.Future[int] = torch.futures.Future()
    fut.set_result(3)
    assert comm.then(fut, lambda f: f.value() + 1).wait() == 4
    assert comm.callbacks_held() == before


def test_the_package_hands_futures_its_callbacks_only_through_comm():
    offenders = []
    for path in (ROOT / "src" / "commhooks").rglob("*.py"):
        if path.relative_to(ROOT / "src" / "commhooks") == Path("comm", "__init__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = ast.unparse(node.func.value)
            if node.func.attr == "add_done_callback" or (
                node.func.attr == "then" and not receiver.endswith(("comm", "issuer"))
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {receiver}")
    assert not offenders, offenders


@pytest.mark.parametrize("how", ["then", "when_done"])
def test_a_script_ending_while_a_worker_thread_holds_a_callback_exits_cleanly(tmp_path, how):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", HOW=how, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=path)  # fmt: skip
    ranks = [
        subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(rank)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]  # fmt: skip
    outputs = [rank.communicate(timeout=90)[0] for rank in ranks]
    for rank, output in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, output[-3000:]
        assert "ending with callbacks held: 1" in output, output[-3000:]
        assert "terminate called" not in output
