"""Callbacks on futures: torch's semantics, and handed over in one place (commhooks.comm)."""

import ast
from pathlib import Path

import pytest
import torch

from commhooks import comm

ROOT = Path(__file__).resolve().parents[1]


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


def test_the_package_hands_futures_its_callbacks_only_through_comm():
    offenders = []
    for path in (ROOT / "src" / "commhooks").rglob("*.py"):
        if path.relative_to(ROOT / "src" / "commhooks").parts[0] == "comm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = ast.unparse(node.func.value)
            ordered = receiver.endswith(("comm", "issuer")) or receiver.startswith("issuers.")
            if node.func.attr == "add_done_callback" or (node.func.attr == "then" and not ordered):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {receiver}")
    assert not offenders, offenders
