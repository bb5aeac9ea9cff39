"""File-level checkpointing: atomic saves, weights-only loads, all-or-nothing restores."""

import pickle

import pytest
import torch
from torch import nn

from commhooks import HookState, StateDictError, checkpoint


class Counter(HookState):
    """A minimal state: exercises the base class without any hook."""

    kind = "test_counter"

    def __init__(self, start: int = 0) -> None:
        super().__init__(None)
        self.count = start
        self.memory = torch.arange(3.0) + start

    def _save(self):
        return {"count": self.count, "memory": self.memory.clone()}

    def _load(self, sd):
        if not isinstance(sd.get("count"), int):
            raise StateDictError("Counter: 'count' must be an int")
        self.count, self.memory = sd["count"], sd["memory"].clone()


class Other(Counter):
    kind = "test_other"


def _trainer(seed: int):
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _snapshot(model, opt):
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [t.clone() for s in opt.state_dict()["state"].values() for t in s.values()]
    return tensors


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_round_trip_and_weights_only(tmp_path):
    model, opt = _trainer(0)
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, model=model, optimizer=opt, hook=Counter(5))
    raw = torch.load(path, weights_only=True)
    assert raw["entries"]["hook"]["kind"] == "test_counter"
    model2, opt2 = _trainer(1)
    state = Counter()
    checkpoint.load(path, model=model2, optimizer=opt2, hook=state)
    assert state.count == 5 and torch.equal(state.memory, torch.arange(3.0) + 5)
    assert torch.equal(model2.weight, model.weight)
    assert list(tmp_path.iterdir()) == [path], "no temporary file left behind"


def test_state_save_and_load(tmp_path):
    Counter(7).save(tmp_path / "s.pt")
    state = Counter()
    state.load(tmp_path / "s.pt")
    assert state.count == 7


def test_truncated_file_is_named_and_changes_nothing(tmp_path):
    model, opt = _trainer(0)
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, model=model, optimizer=opt, hook=Counter(5))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    model2, opt2 = _trainer(1)
    before = _snapshot(model2, opt2)
    state = Counter(1)
    with pytest.raises(checkpoint.CheckpointError, match="truncated, corrupt"):
        checkpoint.load(path, model=model2, optimizer=opt2, hook=state)
    assert _same(_snapshot(model2, opt2), before) and state.count == 1
    with pytest.raises(checkpoint.CheckpointError, match="truncated, corrupt"):
        state.load(path)


def test_foreign_files_are_refused(tmp_path):
    plain = tmp_path / "plain.pt"
    torch.save({"weights": torch.ones(2)}, plain)
    with pytest.raises(checkpoint.CheckpointError, match="not a commhooks checkpoint"):
        checkpoint.load(plain, hook=Counter())
    with pytest.raises(StateDictError, match="not a commhooks state dict"):
        Counter().load(plain)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(text, hook=Counter())
    pickled = tmp_path / "pickled.pt"
    torch.save(Counter(3), pickled)  # a whole object, as the reference saves its state
    with pytest.raises(checkpoint.CheckpointError) as err:
        Counter().load(pickled)
    message = str(err.value)
    assert "weights-only load refuses" in message and "Counter" in message
    assert "weights_only=False" not in message and "state_dict()" in message


@pytest.mark.parametrize("writer", ["random_bytes", "pickle_dump"])
def test_files_torch_did_not_write_are_named_unreadable(tmp_path, writer):
    path = tmp_path / f"{writer}.pt"
    if writer == "random_bytes":
        path.write_bytes(bytes(range(256)) * 4)
    else:
        with open(path, "wb") as f:
            pickle.dump({"hook": {"count": 1}}, f, protocol=4)
    for call in (lambda: checkpoint.load(path, hook=Counter()), lambda: Counter().load(path)):
        with pytest.raises(checkpoint.CheckpointError) as err:
            call()
        message = str(err.value)
        assert str(path) in message and "not a file written by torch.save" in message
        assert "weights-only load refuses" not in message
        assert "weights_only" not in message, "torch's advice to load unsafely must not leak"


def test_wrong_kind_rolls_back_objects_already_loaded(tmp_path):
    model, opt = _trainer(0)
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, model=model, optimizer=opt, hook=Other(9))
    model2, opt2 = _trainer(1)
    before = _snapshot(model2, opt2)
    state = Counter(2)
    with pytest.raises(checkpoint.CheckpointError, match="saved by a 'test_other' state"):
        checkpoint.load(path, model=model2, optimizer=opt2, hook=state)
    assert _same(_snapshot(model2, opt2), before) and state.count == 2


def test_missing_entry_is_named(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, hook=Counter())
    with pytest.raises(checkpoint.CheckpointError, match="no entry for optimizer"):
        checkpoint.load(path, hook=Counter(), optimizer=_trainer(0)[1])


def test_pickling_drops_the_group_and_bind_rebinds():
    state = Counter(4)
    state._process_group = object()  # stands in for a live group, which cannot be pickled
    clone = pickle.loads(pickle.dumps(state))
    assert clone.process_group is None and clone.count == 4
    with pytest.raises(TypeError, match="ProcessGroup or None"):
        clone.bind("not a group")
