"""Hostile and damaged checkpoint files, and saves killed at random moments.

Files that hold pickled objects (possibly code) are refused with that reason, never with
advice to load them unsafely; malformed containers raise ``CheckpointError`` and nothing
else; a SIGKILL at any moment of a save leaves the previous file whole, and the temporary
files it leaves are removed by the next save to the same target.
"""

import functools
import multiprocessing
import os
import random
import signal
import socket
import time

import pytest
import torch

from commhooks import CommHooksWarning, HookState, StateDictError, checkpoint


class Tally(HookState):
    """A state whose entries must stay consistent with each other across a crash."""

    kind = "test_tally"

    def __init__(self, value: int = 0, blob: torch.Tensor | None = None) -> None:
        super().__init__(None)
        self.value = value
        self.blob = blob if blob is not None else torch.zeros(4)

    def _save(self):
        return {"value": self.value, "blob": self.blob, "check": torch.tensor([self.value])}

    def _load(self, sd):
        if not isinstance(sd.get("value"), int):
            raise StateDictError("Tally: 'value' must be an int")
        self.value = sd["value"]


class RunsCode:
    """Unpickling this would run ``os.makedirs(marker)``: what a hostile file does."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


class Plain:
    pass


def _with_entry(value):
    return {"format": checkpoint.FORMAT, "version": 1, "entries": {"hook": value}}


@pytest.mark.parametrize(
    ("name", "make", "global_name"),
    [
        ("code", lambda marker: RunsCode(marker), "makedirs"),
        ("instance", lambda marker: Plain(), "Plain"),
        ("function", lambda marker: functools.partial(print, 1), "functools.partial"),
    ],
)
def test_a_file_holding_globals_is_refused_for_holding_objects(tmp_path, name, make, global_name):
    marker = str(tmp_path / "ran")
    path = tmp_path / f"{name}.pt"
    torch.save(_with_entry(make(marker)), path)
    for load in (lambda: checkpoint.load(path, hook=Tally()), lambda: Tally().load(path)):
        with pytest.raises(checkpoint.CheckpointError) as err:
            load()
        message = str(err.value)
        assert "holds pickled Python objects" in message and "weights-only load refuses" in message
        assert global_name in message, message
        assert "truncated" not in message and "corrupt" not in message, message
        assert "weights_only" not in message, "torch's advice to load unsafely must not leak"
    assert not os.path.exists(marker), "the file's code ran"


MALFORMED = {
    "entries-list": {"format": checkpoint.FORMAT, "version": 1, "entries": [("hook", {})]},
    "entries-none": {"format": checkpoint.FORMAT, "version": 1, "entries": None},
    "entries-missing": {"format": checkpoint.FORMAT, "version": 1},
    "entries-int-keys": {"format": checkpoint.FORMAT, "version": 1, "entries": {1: {}}},
    "version-bool": {"format": checkpoint.FORMAT, "version": True, "entries": {}},
    "version-zero": {"format": checkpoint.FORMAT, "version": 0, "entries": {}},
    "version-float": {"format": checkpoint.FORMAT, "version": float("inf"), "entries": {}},
    "version-str": {"format": checkpoint.FORMAT, "version": "1", "entries": {}},
    "entry-list": _with_entry([1, 2]),
    "entry-none": _with_entry(None),
    "entry-bad-version": _with_entry({"kind": "test_tally", "version": float("inf")}),
    "top-level-list": [1, 2, 3],
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_containers_raise_checkpoint_error_only(tmp_path, name):
    path = tmp_path / f"{name}.pt"
    torch.save(MALFORMED[name], path)
    state = Tally(7)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(path, hook=state)
    assert state.value == 7


def test_load_names_and_returns_the_entries_it_did_not_load(tmp_path):
    path = tmp_path / "ckpt.pt"
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint.save(path, model=model, optimizer=opt, hook=Tally(3))
    state = Tally()
    with pytest.warns(CommHooksWarning, match="also holds model, optimizer, which were not"):
        left = checkpoint.load(path, hook=state)
    assert left == ["model", "optimizer"] and state.value == 3


def test_save_fsyncs_the_file_and_its_directory_around_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    checkpoint.save(tmp_path / "ckpt.pt", hook=Tally(1))
    assert events == ["fsync-file", "fsync-dir", "rename", "fsync-dir"], events


def _save_forever(path, blob):
    value = 0
    while True:
        value += 1
        checkpoint.save(path, hook=Tally(value, blob))


def _leftovers(folder):
    return [n for n in os.listdir(folder) if n.startswith(".commhooks-")]


@pytest.mark.timeout(60)
def test_sigkill_at_random_moments_of_a_save_keeps_the_previous_file(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    blob = torch.arange(2_000_000, dtype=torch.float32)  # 8 MB: a save takes a while
    checkpoint.save(path, hook=Tally(0, blob))
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    left_behind = 0
    for _ in range(12):
        writer = ctx.Process(target=_save_forever, args=(path, blob))
        writer.start()
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        left_behind = max(left_behind, len(_leftovers(tmp_path)))
        entry = checkpoint.read(path)["hook"]  # whole, whichever save it is from
        assert int(entry["check"]) == entry["value"] and torch.equal(entry["blob"], blob)
    checkpoint.save(path, hook=Tally(-1, blob))
    assert _leftovers(tmp_path) == [], "the next save must remove what killed saves left"
    assert checkpoint.read(path)["hook"]["value"] == -1


def test_leftovers_of_live_writers_and_of_other_targets_are_kept(tmp_path):
    host = socket.gethostname().replace(".", "_")
    dead = multiprocessing.get_context("fork").Process(target=int)
    dead.start()
    dead.join()
    names = {
        "dead": f".commhooks-ckpt.pt.{host}.{dead.pid}.abc.tmp",
        "alive": f".commhooks-ckpt.pt.{host}.{os.getppid()}.abc.tmp",
        "other-target": f".commhooks-other.pt.{host}.{dead.pid}.abc.tmp",
        "old-stale": ".commhooks-x1y2z3.tmp",
        "old-fresh": ".commhooks-a1b2c3.tmp",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    stale = time.time() - 3600
    os.utime(tmp_path / names["old-stale"], (stale, stale))
    checkpoint.save(tmp_path / "ckpt.pt", hook=Tally(1))
    kept = set(_leftovers(tmp_path))
    assert kept == {names["alive"], names["other-target"], names["old-fresh"]}, kept


def _trained_states():
    """A quantized and a PowerSGD state's dicts, with memories, saved without a process group."""
    from commhooks.hooks.powersgd import PowerSGDState
    from commhooks.hooks.quantized import QuantizationState

    quantized = QuantizationState(None, bits=8)
    quantized.error.record(0, torch.ones(4))
    quantized.owner_error.record("0:0-4", torch.ones(4))
    powersgd = PowerSGDState(None, start_powerSGD_iter=0)
    powersgd.memory.record(0, torch.ones(4, 4))
    return {"error": quantized, "owner_error": quantized, "powersgd": powersgd}


_ODD_MEMORIES = {
    "meta": (torch.zeros(4, device="meta"), "'meta' device"),
    "float8": (torch.zeros(4).to(torch.float8_e4m3fn), "float8_e4m3fn"),
}


@pytest.mark.parametrize("odd", list(_ODD_MEMORIES))
@pytest.mark.parametrize("entry", ["error", "owner_error", "powersgd"])
def test_a_memory_on_meta_or_in_float8_is_refused_naming_the_entry(tmp_path, entry, odd):
    state = _trained_states()[entry]
    sd = state.state_dict()
    bad, reason = _ODD_MEMORIES[odd]
    if entry == "powersgd":
        bad, key = bad.view(2, 2), "error"
        sd[key] = {"0": bad}
    else:
        key = entry
        sd[key] = {next(iter(sd[key])): bad}
    before = {k: v.clone() for k, v in state.state_dict()[key].items()}
    with pytest.raises(StateDictError, match=rf"'?{key}'?\['0[^\]]*'\].*{reason}"):
        state.load_state_dict(sd)
    path = tmp_path / "state.pt"
    torch.save(sd, path)
    with pytest.raises(StateDictError, match=reason):
        state.load(path)
    after = state.state_dict()[key]
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing changed


def test_a_cuda_generator_state_is_refused_at_load_on_a_run_without_cuda(monkeypatch):
    from commhooks.hooks.quantized import QuantizationState

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = QuantizationState(None, rounding="stochastic")
    sd = {**state.state_dict(), "generators": torch.zeros(2, 16, dtype=torch.uint8)}
    with pytest.raises(StateDictError, match="'generators' holds a CUDA generator's state"):
        state.load_state_dict(sd)
    cpu = torch.stack([torch.Generator().get_state() for _ in range(2)])
    state.load_state_dict({**sd, "generators": cpu})  # a CPU run's states load
