"""Streaming DiLoCo against careless or hostile input: models with empty modules, state dicts
that do not fit the model or hold absurd settings, and workers whose models differ."""

import warnings

import pytest
import torch
from torch import nn

import commhooks
from commhooks.averaging.diloco import split_by_module
from commhooks.testing import run_on_ranks

pytestmark = pytest.mark.timeout(60)


class _EmptyLast(nn.Module):
    """A model whose last module holds no element (a head of width 0), still in the graph."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 4)
        self.empty = nn.Linear(4, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mid(torch.relu(self.body(x)))
        return torch.cat([y, self.empty(y)], dim=1)


def _empty_model() -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Initializing zero-element tensors"
        return _EmptyLast()


# -- 4: modules of no elements ------------------------------------------------------------------
def test_a_module_of_no_elements_joins_the_fragment_before_it():
    named = list(_empty_model().named_parameters())
    assert split_by_module(named, 1) == [[n for n, _ in named]]
    assert split_by_module(named, 2) == [
        ["body.weight", "body.bias"],
        ["mid.weight", "mid.bias", "empty.weight", "empty.bias"],
    ]
    first = [("a.weight", torch.zeros(0)), *named]  # first in line: joins fragment 0
    assert split_by_module(first, 2)[0][0] == "a.weight"
    with pytest.raises(ValueError, match=r"lie in 2 modules \(of 3\); pass fragments <= 2"):
        split_by_module(named, 3)
    with pytest.raises(ValueError, match=r"fragment\(s\) \[1\] hold only parameters of no"):
        split_by_module(named, (("body", "mid"), ("empty",)))


def _train_empty_last(rank, world_size, bits):
    model = _empty_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = commhooks.StreamingDiLoCo(sync_every=2, fragments=2, bits=bits)
    diloco.attach(inner, model.named_parameters())
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        inner.zero_grad()
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        inner.step()
    diloco.finish()
    return diloco.plan, diloco.snapshot


@pytest.mark.parametrize("bits", [None, 4])
def test_a_model_whose_last_module_has_no_elements_trains(bits):
    (plan, first), (_, second) = run_on_ranks(_train_empty_last, 2, bits)
    assert plan[1][-2:] == ["empty.weight", "empty.bias"]
    start = dict(_empty_model().named_parameters())
    for name, value in first.items():  # both fragments synced: the same global parameters
        assert torch.equal(value, second[name]), name
        assert value.numel() == 0 or not torch.equal(value, start[name]), name


# -- 1 and 2: a loaded state must fit the model, and its settings must be sane ------------------
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))  # '0.weight': 16 x 8


def _averager(**options) -> "commhooks.StreamingDiLoCo":
    return commhooks.StreamingDiLoCo(sync_every=4, fragments=2, fragment_sync_delay=1, **options)


def _attached(**options):
    model = _model()
    diloco = _averager(**options)
    diloco.attach(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    return diloco


def _saved(rank, world_size):
    """A state saved after 7 steps: both fragments synced (momentum), fragment 1 in flight."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = _averager()
    diloco.attach(inner, model.named_parameters())
    gen = torch.Generator().manual_seed(rank)
    for _ in range(7):
        inner.zero_grad()
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        inner.step()
    return diloco.state_dict()


@pytest.fixture(scope="module")
def saved():
    state = run_on_ranks(_saved, 2)[0]
    assert state["in_flight"]["fragment"] == 1 and state["plan"][0][0] == "0.weight"
    assert state["outer_optimizers"][0]["state"][0]["momentum_buffer"].shape == (16, 8)
    return state


def _with(state, snapshot=None, momentum=None, group=None, flight=None):
    """``state`` with '0.weight' of the global parameters, its outer momentum, the first outer
    optimizer's param group or the fragment in flight changed."""
    outer = state["outer_optimizers"][0]
    entry = {**outer["state"][0]}
    if momentum is not None:
        entry["momentum_buffer"] = momentum
    groups = [{**outer["param_groups"][0], **(group or {})}]
    first = {**outer, "state": {**outer["state"], 0: entry}, "param_groups": groups}
    return {
        **state,
        "snapshot": {
            **state["snapshot"],
            **({"0.weight": snapshot} if snapshot is not None else {}),
        },
        "outer_optimizers": [first, *state["outer_optimizers"][1:]],
        "in_flight": {**state["in_flight"], **(flight or {})},
    }


def _unchanged_by(diloco, state, match):
    before = diloco.state_dict()
    with pytest.raises(commhooks.StateDictError, match=match):
        diloco.load_state_dict(state)
    after = diloco.state_dict()
    assert after["step"] == before["step"] and after["plan"] == before["plan"]
    for name, tensor in before["snapshot"].items():
        assert torch.equal(after["snapshot"][name], tensor)


@pytest.mark.parametrize(
    ("snapshot", "says"),
    [
        (torch.zeros(1, 8), r"is \(1, 8\) torch\.float32, the model's parameter \(16, 8\)"),
        (torch.zeros(8, 16), r"is \(8, 16\) torch\.float32, the model's parameter \(16, 8\)"),
        (torch.zeros(16, 8, dtype=torch.float64), r"is \(16, 8\) torch\.float64, the model's"),
    ],
    ids=["a-row", "transposed", "float64"],
)
def test_global_parameters_of_another_shape_or_dtype_are_refused_at_load(saved, snapshot, says):
    momentum = torch.zeros(snapshot.shape)  # consistent with it: only the model tells
    bad = _with(saved, snapshot=snapshot, momentum=momentum)
    _unchanged_by(_attached(), bad, r"'snapshot'\['0\.weight'\] " + says)
    late = _averager()  # loaded before attach: attach refuses it, naming the entry
    late.load_state_dict(bad)
    model = _model()
    with pytest.raises(commhooks.StateDictError, match=r"attach: .*'snapshot'\['0\.weight'\]"):
        late.attach(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    good = _attached()
    good.load_state_dict(saved)
    assert good.plan == saved["plan"]


def test_a_global_parameter_the_model_lacks_is_refused(saved):
    foreign = {**saved, "snapshot": {**saved["snapshot"], "9.weight": torch.zeros(2)}}
    foreign["plan"] = [saved["plan"][0] + ["9.weight"], saved["plan"][1]]
    _unchanged_by(_attached(), foreign, r"'snapshot'\['9\.weight'\] is no parameter of the model")


def test_a_scalar_outer_momentum_is_refused(saved):
    scalar = _with(saved, momentum=torch.tensor(0.5))
    _unchanged_by(_attached(), scalar, r"fragment 0 'state'\[0\]\['momentum_buffer'\] must have")


@pytest.mark.parametrize(
    ("group", "says"),
    [
        ({"lr": float("nan")}, r"'param_groups'\[0\]\['lr'\] must be a finite number"),
        ({"lr": "0.7"}, r"'param_groups'\[0\]\['lr'\] must be a finite number"),
        ({"momentum": "abc"}, r"'param_groups'\[0\]\['momentum'\] must be a finite number"),
        ({"nesterov": 1}, r"'param_groups'\[0\]\['nesterov'\] must be True or False"),
    ],
    ids=["lr-nan", "lr-string", "momentum-string", "nesterov-int"],
)
def test_outer_settings_that_are_not_numbers_are_refused_naming_the_entry(saved, group, says):
    _unchanged_by(_attached(), _with(saved, group=group), says)


def test_absurd_outer_gradients_and_momenta_are_refused_at_load(saved):
    size = saved["in_flight"]["average"].numel()
    huge = _with(saved, flight={"average": torch.full((size,), 1e30)})
    _unchanged_by(_attached(), huge, r"'in_flight' 'average' reaches 1e\+30, beyond any training")
    momentum = _with(saved, momentum=torch.full((16, 8), 1e30))
    _unchanged_by(_attached(), momentum, r"\['momentum_buffer'\] reaches 1e\+30")
    tenfold = saved["in_flight"]["average"] * 10  # large, but a training step: loads
    _attached().load_state_dict(_with(saved, flight={"average": tenfold}))


def test_the_options_built_with_win_over_saved_settings_and_the_handshake_agrees(saved):
    resumed = _attached(outer_lr=0.1)
    with pytest.warns(commhooks.CommHooksWarning, match=r"outer_lr: saved 0\.7, kept 0\.1"):
        resumed.load_state_dict(saved)
    assert all(o.param_groups[0]["lr"] == 0.1 for o in resumed.outer_optimizers)
    assert resumed.handshake_fields()["outer_lr"] == 0.1
    absurd = _attached()
    with pytest.warns(commhooks.CommHooksWarning, match=r"outer_lr: saved 1e\+30, kept 0\.7"):
        absurd.load_state_dict(_with(saved, group={"lr": 1e30}))
    assert [o.param_groups[0]["lr"] for o in absurd.outer_optimizers] == [0.7, 0.7]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _attached().load_state_dict(saved)  # the same settings: not a word


def _outer_averager_state(lr: float) -> dict:
    """A synced OuterOptimizerAverager's state dict, its outer SGD at ``lr`` with momentum."""
    weight = torch.ones(2, 3)
    outer = torch.optim.SGD([weight], lr=lr, momentum=0.9, nesterov=True)
    weight.grad = torch.full((2, 3), 0.1)
    outer.step()
    return {
        "kind": "outer_optimizer_averager",
        "version": 2,
        "step": 4,
        "warmup_steps": 0,
        "period": 2,
        "snapshot": {"w": weight.detach().clone()},
        "outer_optimizer": outer.state_dict(),
        "synced": True,
    }


def test_the_outer_optimizer_averager_follows_the_same_rules():
    averager = commhooks.OuterOptimizerAverager(2, outer_lr=0.1)
    with pytest.warns(commhooks.CommHooksWarning, match=r"outer_lr: saved 0\.7, kept 0\.1"):
        averager.load_state_dict(_outer_averager_state(0.7))
    assert averager.outer_optimizer.param_groups[0]["lr"] == 0.1
    damaged = _outer_averager_state(0.7)
    damaged["outer_optimizer"]["param_groups"][0]["lr"] = float("nan")
    with pytest.raises(commhooks.StateDictError, match=r"\['lr'\] must be a finite number"):
        commhooks.OuterOptimizerAverager(2).load_state_dict(damaged)


# -- 9: workers with models of different sizes ---------------------------------------------------
def _different_models(rank, world_size, bits, attach):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16 + 8 * rank), nn.ReLU(), nn.Linear(16 + 8 * rank, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    diloco = commhooks.StreamingDiLoCo(sync_every=2, fragments=2, bits=bits)
    if attach:
        diloco.attach(inner, model.named_parameters())
    try:
        for _ in range(2):
            inner.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            inner.step()
            if not attach:
                diloco.average_parameters(model.parameters())
    except ValueError as exc:
        return str(exc), diloco.step, diloco.plan
    return None, diloco.step, diloco.plan


@pytest.mark.parametrize(("bits", "attach"), [(None, True), (4, True), (4, False)])
def test_workers_with_models_of_different_sizes_are_named_at_the_first_sync(bits, attach):
    for message, step, plan in run_on_ranks(_different_models, 2, bits, attach):
        assert message is not None and "do not train the same model" in message
        assert "rank 0: 4 tensors, 212 elements" in message
        assert "rank 1: 4 tensors, 316 elements" in message
        assert step == 0 and plan is None  # refused before anything was sent or changed
