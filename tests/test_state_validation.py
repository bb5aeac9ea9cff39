"""State dicts of post-local SGD, the averagers and PostLocalSGDOptimizer: every tensor checked.

A hostile or damaged state dict raises ``StateDictError`` naming the entry, and changes
nothing: a tensor that claims far more elements than its file holds (a stride-0 expand), one
with a NaN, of another dtype or shape; a version or counter that is not a positive or
non-negative integer; a container of the wrong type.
"""

import pytest
import torch

import commhooks
from commhooks.state import StateDictError

HUGE = torch.zeros(1).expand(10**9)  # 4 bytes in a file, 4 GB once copied


def _outer_sd(**changes):
    param = torch.nn.Parameter(torch.ones(2, 3))
    param.grad = torch.zeros(2, 3)
    averager = commhooks.OuterOptimizerAverager(2)
    averager._start_from({"w": param.detach().clone()})  # a sync, without a process group
    assert averager.outer_optimizer is not None
    snapshot = averager.snapshot
    snapshot["w"].grad = torch.ones(2, 3)
    averager.outer_optimizer.step()  # momentum buffers to save
    return {**averager.state_dict(), **changes}


def _momentum(value):
    sd = _outer_sd()
    outer = sd["outer_optimizer"]
    state = {0: {**outer["state"][0], "momentum_buffer": value}}
    return {**sd, "outer_optimizer": {**outer, "state": state}}


OUTER_CASES = {
    "snapshot-nan": (_outer_sd(snapshot={"w": torch.full((2, 3), float("nan"))}), "inf or NaN"),
    "snapshot-expanded": (_outer_sd(snapshot={"w": HUGE}), "dense, contiguous"),
    "snapshot-transposed": (_outer_sd(snapshot={"w": torch.ones(3, 2).t()}), "contiguous"),
    "snapshot-int": (_outer_sd(snapshot={"w": torch.ones(2, 3, dtype=torch.int64)}), "floating"),
    "snapshot-not-tensor": (_outer_sd(snapshot={"w": [1.0]}), "must be a (floating-point )?tensor"),
    "snapshot-none": (_outer_sd(snapshot=None), "'snapshot' is missing or malformed"),
    "snapshot-empty": (_outer_sd(snapshot={}), "a tensor per parameter"),
    "momentum-nan": (_momentum(torch.full((2, 3), float("nan"))), "momentum_buffer"),
    "momentum-expanded": (_momentum(HUGE), "dense, contiguous"),
    "momentum-shape": (_momentum(torch.ones(3, 3)), r"its parameter has \(2, 3\)"),
    "outer-list": (_outer_sd(outer_optimizer=[1]), "outer optimizer state"),
    "step-inf": (_outer_sd(step=float("inf")), "'step' must be a non-negative integer"),
    "step-bool": (_outer_sd(step=True), "'step' must be a non-negative integer"),
    "warmup-huge-float": (_outer_sd(warmup_steps=1e300), "'warmup_steps'"),
    "version-zero": (_outer_sd(version=0), "version must be a positive integer"),
    "version-bool": (_outer_sd(version=True), "version must be a positive integer"),
}


@pytest.mark.parametrize("name", list(OUTER_CASES))
def test_outer_averager_refuses_bad_tensors_and_counters(name):
    sd, message = OUTER_CASES[name]
    averager = commhooks.OuterOptimizerAverager(2)
    with pytest.raises(StateDictError, match=message):
        averager.load_state_dict(sd)
    assert averager.step == 0 and averager.snapshot is None


def test_outer_averager_loads_its_own_state_dict_and_an_earlier_positional_one():
    sd = _outer_sd()
    fresh = commhooks.OuterOptimizerAverager(2)
    fresh.load_state_dict(sd)
    assert list(fresh.snapshot) == ["w"] and torch.equal(fresh.snapshot["w"], sd["snapshot"]["w"])
    old = {**sd, "version": 1, "snapshot": [torch.ones(2, 3)]}
    older = commhooks.OuterOptimizerAverager(2)
    older.load_state_dict(old)
    assert list(older.snapshot) == ["0"]


@pytest.mark.parametrize(
    ("value", "message"),
    [(-1, ">= 0"), (1.5, "integer"), (float("inf"), "inf"), (True, "integer"), ("3", "'3'")],
)
def test_post_local_sgd_state_refuses_a_bad_step_count(value, message):
    state = commhooks.PostLocalSGDState(None, None, 2)
    sd = {**state.state_dict(), "iter": value}
    with pytest.raises(StateDictError, match=message):
        state.load_state_dict(sd)
    assert state.iter == 0


@pytest.mark.parametrize(("buckets", "message"), [("0,1", "must be a list"), ([[1], [1]], "two")])
def test_post_local_sgd_state_refuses_bad_buckets_and_keeps_its_step(buckets, message):
    state = commhooks.PostLocalSGDState(None, None, 2)
    sd = {**state.state_dict(), "iter": 5, "buckets": buckets}
    with pytest.raises(StateDictError, match=f"'buckets'.*{message}"):
        state.load_state_dict(sd)
    assert state.iter == 0 and state.buckets.saved() == []


@pytest.mark.parametrize("sd", [[1, 2], None, {"kind": "post_local_sgd"}, {"version": 1}])
def test_malformed_containers_raise_state_dict_error(sd):
    with pytest.raises(StateDictError):
        commhooks.PostLocalSGDState(None, None, 2).load_state_dict(sd)
    with pytest.raises(StateDictError):
        commhooks.PeriodicModelAverager(2).load_state_dict(sd)


def _wrapper():
    p = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    inner.step()
    return commhooks.PostLocalSGDOptimizer(inner, commhooks.PeriodicModelAverager(2))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda sd: sd["state"][0].update(momentum_buffer=torch.full((3,), float("nan"))), "NaN"),
        (lambda sd: sd["state"][0].update(momentum_buffer=HUGE), "dense, contiguous"),
        (lambda sd: sd["state"][0].update(momentum_buffer=torch.ones(4)), "shape"),
        (lambda sd: sd.update(averager=[1]), "'averager' entry"),
        (lambda sd: sd.update(state=[1]), "inner optimizer"),
        (lambda sd: sd.update(step=float("inf")), "'step'"),
    ],
)
def test_post_local_sgd_optimizer_refuses_bad_entries_and_changes_nothing(change, message):
    wrapper = _wrapper()
    sd = wrapper.state_dict()
    sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
    change(sd)
    before = wrapper.optim.state_dict()
    with pytest.raises(StateDictError, match=message):
        wrapper.load_state_dict(sd)
    after = wrapper.optim.state_dict()
    assert torch.equal(after["state"][0]["momentum_buffer"], before["state"][0]["momentum_buffer"])
    assert wrapper.averager.step == 0


def _options_classes():
    """Every options class of the package (imported through the public modules)."""
    import commhooks.averaging.averagers
    import commhooks.hooks.local_sgd
    import commhooks.hooks.powersgd
    import commhooks.hooks.quantized  # noqa: F401
    from commhooks.options import Options

    found, todo = [], [Options]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return [c for c in found if c.__module__.startswith("commhooks")]


_REQUIRED = {
    "start_localSGD_iter": 2,
    "period": 2,
    "period_group_size_dict": {2: 2},
    "sync_every": 4,
}


def _integer_options():
    import dataclasses

    for cls in _options_classes():
        for f in dataclasses.fields(cls):
            if f.type in (int, "int"):
                yield cls, f.name


@pytest.mark.parametrize(
    ("cls", "name"), list(_integer_options()), ids=lambda v: getattr(v, "__name__", v)
)
def test_every_integer_option_refuses_a_float_naming_the_option(cls, name):
    base = {n: _REQUIRED[n] for n in cls.required()}
    valid = cls(**base).as_dict()[name] if name not in base else base[name]
    for wrong in (float(valid), True):
        with pytest.raises(ValueError, match=rf"{cls.owner}: {name} must be"):
            cls(**{**base, name: wrong})


def test_quantization_bits_as_float_is_refused_at_construction():
    from commhooks.hooks.quantized import QuantizationState

    for bits in (8.0, 4.0):
        with pytest.raises(ValueError, match=r"bits must be an integer \(\d without the point\)"):
            QuantizationState(None, bits=bits)
    with pytest.raises(ValueError, match="block_size must be an integer"):
        QuantizationState(None, block_size=256.0)
    assert QuantizationState(None, bits=4).settings.format.bits == 4
