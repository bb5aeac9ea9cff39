"""Streaming DiLoCo against careless or hostile input: models with empty modules, state dicts
that do not fit the model or hold absurd settings, workers whose models differ, warm-up options
that differ between ranks, a worker's NaN, a step a loss scaler skips on one worker, and a
resume inside a quantized warm-up of several DDP buckets."""

import copy
import functools
import pickle
import time
import warnings

import pytest
import torch
from ddp_utils import HostReads, batches, flat_params, make_ddp, make_mlp
from torch import nn

import commhooks
from commhooks.averaging.diloco import diloco_hook, split_by_module
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


# -- 5: warm-up options that differ between ranks, named before the warm-up sends anything -----
def _warmup_differs(rank, world_size, option, values):
    ddp = make_ddp(make_mlp())
    options = {"warmup_steps": 2, option: values[rank]}
    diloco = commhooks.register(ddp, "streaming_diloco", sync_every=4, **options)
    inner = torch.optim.SGD(ddp.parameters(), lr=0.05)
    diloco.attach(inner, ddp.module.named_parameters())
    start = time.monotonic()
    try:
        for x, y in batches(rank, 2):
            inner.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            inner.step()
    except ValueError as exc:
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.parametrize(
    ("option", "values", "says"),
    [
        ("warmup_steps", (0, 2), "warmup_steps: rank 0=0, rank 1=2"),
        ("warmup_bits", (None, 8), "warmup_bits: rank 0=None, rank 1=8"),
    ],
)
def test_warmup_options_that_differ_between_ranks_are_named_on_every_rank(option, values, says):
    # A group timeout of 10 s: waiting for it (the warm-up's collectives against nothing) would
    # take longer than the error that names the option.
    results = run_on_ranks(_warmup_differs, 2, option, values, pg_timeout=10, timeout=40)
    for message, seconds in results:
        assert message is not None and says in message, message
        assert "StreamingDiLoCo was configured differently" in message
        assert "same options" in message
        assert seconds < 5


# -- 6: an outer gradient that is not finite leaves the outer state as it was -------------------
def _momenta(diloco):
    """The outer momentum buffers, by fragment and parameter."""
    return {
        (f, i): o.state[p]["momentum_buffer"].clone()
        for f, o in enumerate(diloco.outer_optimizers)
        for i, p in enumerate(o.param_groups[0]["params"])
        if "momentum_buffer" in o.state.get(p, {})
    }


def _nan_on_one_worker(rank, world_size, bits, fragments):
    """Rank 0's gradient is NaN at step 2; the global parameters and outer momenta after each
    step, the host reads of each step's optimizer step (where the syncs run), the parameters."""
    ddp = make_ddp(make_mlp())
    diloco = commhooks.register(
        ddp, "streaming_diloco", sync_every=4, fragments=fragments, bits=bits
    )
    inner = torch.optim.SGD(ddp.parameters(), lr=0.05)
    diloco.attach(inner, ddp.module.named_parameters())
    history, reads, at_global = [], [], []
    for step, (x, y) in enumerate(batches(rank, 12)):
        inner.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        if step == 2 and rank == 0:
            ddp.module[0].weight.grad.view(-1)[0] = float("nan")
        with HostReads() as counted:
            inner.step()
        reads.append(counted.count)
        history.append(({n: t.clone() for n, t in diloco.snapshot.items()}, _momenta(diloco)))
        named = ddp.module.named_parameters()
        at_global.append(all(torch.equal(p, diloco.snapshot[n]) for n, p in named))
    return history, reads, at_global, flat_params(ddp.module)


def _finite(tensors):
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.mark.parametrize(("bits", "fragments"), [(None, 1), (None, 2), (4, 2)])
def test_a_non_finite_outer_gradient_leaves_the_outer_state_and_training_goes_on(bits, fragments):
    (history, reads, at_global, params), (other, _, _, other_params) = run_on_ranks(
        _nan_on_one_worker, 2, bits, fragments
    )
    assert at_global[3]  # the NaN worker's parameters, every fragment's, went back to global
    # The NaN step is step 2; the sync after step 3 averages it (fragment 1 of 2, or the one).
    before, after = history[2], history[3]
    for name, tensor in before[0].items():
        assert torch.equal(after[0][name], tensor), name  # the global parameters as they were
    for key, momentum in after[1].items():  # the outer momentum as it was: none is zeros
        was = before[1].get(key, torch.zeros_like(momentum))
        assert torch.equal(momentum, was), key
    for (snapshot, momenta), (their_snapshot, their_momenta) in zip(history, other):
        assert _finite(snapshot.values()) and _finite(momenta.values())
        assert all(torch.equal(t, their_snapshot[n]) for n, t in snapshot.items())
        assert all(torch.equal(t, their_momenta[k]) for k, t in momenta.items())
    moved = [n for n, t in history[-1][0].items() if not torch.equal(t, after[0][n])]
    assert moved  # later syncs were finite and moved the global parameters
    assert _finite([params, other_params])
    # The reads are one-off gathers (4 each: the model's description at the first sync, each
    # int4 fragment's handshake at its first average, and the group's machines at the first
    # quantized average); no sync reads a value back, the one undone included.
    first_uses = [4, 0, 0, 0] if bits is None else [4, 8, 0, 4]
    assert reads == first_uses + [0] * 8


def _outer_averager_nan(rank, world_size):
    """Syncs after steps 1, 3, 5, 7; rank 0's gradient is NaN at step 2."""
    model = make_mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = commhooks.OuterOptimizerAverager(period=2, warmup_steps=1)
    averager.attach(inner, model.named_parameters())
    kept = []
    for step, (x, y) in enumerate(batches(rank, 8)):
        inner.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step == 2 and rank == 0:
            model[0].weight.grad.view(-1)[0] = float("nan")
        inner.step()
        state = averager.outer_optimizer.state
        momenta = [s["momentum_buffer"].clone() for s in state.values()]
        kept.append(([t.clone() for t in averager.snapshot.values()], momenta))
    return kept, flat_params(model)


def test_the_outer_optimizer_averager_leaves_its_outer_state_as_it_was_too():
    (kept, params), (_, other) = run_on_ranks(_outer_averager_nan, 2)
    for before, after in zip(kept[2], kept[3]):  # the sync after step 3 is undone
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(_finite(snapshot) and _finite(momenta) for snapshot, momenta in kept)
    assert not all(torch.equal(a, b) for a, b in zip(kept[3][0], kept[7][0]))  # then it moves
    assert torch.equal(params, other) and _finite([params])


# -- 7: a step a loss scaler skips on one worker alone ------------------------------------------
def _scaled(rank, world_size, build, skip):
    """Train 10 steps with a GradScaler, rank 0's step 2 skipped (an inf in its gradient) and
    ``end_step()`` after each; or, with ``skip=False``, rank 0's step 2 taken with zero
    gradients (plain SGD: a step that changes nothing). Each step's count, the parameters."""
    model, averager = build()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    averager.attach(inner, model.named_parameters())
    scaler = torch.amp.GradScaler("cpu")
    steps = []
    for step, (x, y) in enumerate(batches(rank, 10)):
        inner.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if step == 2 and rank == 0:
            for p in model.parameters():
                p.grad.fill_(float("inf")) if skip else p.grad.zero_()
        scaler.step(inner)
        scaler.update()
        averager.end_step()
        steps.append(averager.step)
    if hasattr(averager, "finish"):
        averager.finish()
    return steps, flat_params(model)


def _diloco_worker(delay):
    ddp = make_ddp(make_mlp())
    diloco = commhooks.register(
        ddp, "streaming_diloco", sync_every=4, fragments=2, fragment_sync_delay=delay
    )
    return ddp.module, diloco


def _finish_after_a_reload(rank, world_size):
    """A fragment in flight saved, two more steps, the save loaded back into the same averager
    and finish() at once: whether the parameters were left alone."""
    ddp = make_ddp(make_mlp())
    diloco = commhooks.register(
        ddp, "streaming_diloco", sync_every=4, fragments=2, fragment_sync_delay=1
    )
    inner = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    diloco.attach(inner, ddp.module.named_parameters())
    saved, later = None, 0
    for x, y in batches(rank, 12):
        _train(ddp, inner, [(x, y)])
        if saved is None and diloco.in_flight is not None:
            saved = copy.deepcopy(diloco.state_dict())
        elif saved is not None:
            later += 1
            if later == 2:
                break
    diloco.load_state_dict(saved)
    before = flat_params(ddp.module)
    diloco.finish()
    return torch.equal(flat_params(ddp.module), before)


def test_finish_right_after_a_load_applies_the_loaded_fragment_to_nothing():
    # The loaded fragment belongs to the parameters of the step it was saved at; until a step
    # shows which tensors are those, finish() must not write it into the last ones it saw.
    assert run_on_ranks(_finish_after_a_reload, 2) == [True, True]


def _periodic():
    return make_mlp(), commhooks.PeriodicModelAverager(period=2, warmup_steps=1)


@pytest.mark.parametrize(
    "build",
    [
        functools.partial(_diloco_worker, 0),
        functools.partial(_diloco_worker, 1),
        _periodic,
    ],
    ids=["diloco-delay-0", "diloco-delay-1", "periodic"],
)
def test_a_step_a_loss_scaler_skips_on_one_worker_is_counted_and_the_schedules_stay_aligned(
    build,
):
    skipped = run_on_ranks(_scaled, 2, build, True)
    taken = run_on_ranks(_scaled, 2, build, False)
    for (steps, params), (_, reference) in zip(skipped, taken):
        assert steps == list(range(1, 11))
        assert torch.equal(params, reference)  # as if the step was taken and changed nothing


def test_end_step_without_an_attached_optimizer_names_the_fix():
    averager = commhooks.PeriodicModelAverager(period=2)
    with pytest.raises(ValueError, match=r"attached to none\. Attach it"):
        averager.end_step()


# -- 8: a resume inside a quantized warm-up of several DDP buckets -----------------------------
def _build_warmup(unpickled=None):
    """DDP of three buckets once DDP rebuilt them, in a quantized warm-up of 4 steps: the
    averager registered, or ``unpickled`` registered by hand."""
    ddp = make_ddp(make_mlp(), bucket_cap_mb=0.004)
    if unpickled is None:
        diloco = commhooks.register(
            ddp, "streaming_diloco", sync_every=4, fragments=2, warmup_steps=4, warmup_bits=4
        )
    else:
        diloco = unpickled
        ddp.register_comm_hook(diloco, diloco_hook)
    inner = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    diloco.attach(inner, ddp.module.named_parameters())
    return ddp, inner, diloco


def _train(ddp, inner, data):
    for x, y in data:
        inner.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        inner.step()


def _pickled_as_the_last_release_did(diloco):
    """The averager pickled with the warm-up's buckets on itself, not on its quantizer, under
    the name their class had then."""
    quantizer = diloco.warmup_quantizer
    kept = quantizer.buckets
    del quantizer.buckets
    diloco.warmup_buckets = kept
    try:
        data = pickle.dumps(diloco, protocol=2)  # names its globals as text
        now = b"ccommhooks.hooks.buckets\nSavedBuckets\n"
        assert now in data
        return data.replace(now, b"ccommhooks.averaging.buckets\nWarmupBuckets\n")
    finally:
        del diloco.warmup_buckets
        quantizer.buckets = kept


def _resume_in_warmup(rank, world_size, cut):
    """Train 8 steps, saving after ``cut`` (inside the warm-up); resume the save in a fresh DDP
    model, by load_state_dict (of the state dict, and of it as earlier releases wrote it, the
    buckets held by the averager alone) and by unpickling, and train to the end again. The
    parameters of the five runs (the last unpickled as the last release pickled), the saved
    state and the warnings of the save."""
    data = batches(rank, 8)
    ddp, inner, diloco = _build_warmup()
    _train(ddp, inner, data[:cut])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = diloco.state_dict()
    model, optimizer = copy.deepcopy(ddp.module.state_dict()), copy.deepcopy(inner.state_dict())
    pickled, older_pickle = pickle.dumps(diloco), _pickled_as_the_last_release_did(diloco)
    _train(ddp, inner, data[cut:])
    runs = [flat_params(ddp.module)]
    quantizer = {k: v for k, v in state["warmup_quantizer"].items() if k != "buckets"}
    older = {**state, "warmup_quantizer": quantizer}
    for loaded in (state, older, pickle.loads(pickled), pickle.loads(older_pickle)):
        unpickled = None if isinstance(loaded, dict) else loaded
        again, inner_again, resumed = _build_warmup(unpickled)
        again.module.load_state_dict(model)
        inner_again.load_state_dict(copy.deepcopy(optimizer))  # it keeps the tensors it loads
        if unpickled is None:
            resumed.load_state_dict(loaded)
        _train(again, inner_again, data[cut:])
        runs.append(flat_params(again.module))
    return runs, state, [str(w.message) for w in caught]


def test_a_resume_inside_a_quantized_warmup_of_several_buckets_is_bitwise():
    for runs, state, caught in run_on_ranks(_resume_in_warmup, 2, 2):
        straight, *resumed = runs
        assert len(resumed) == 4 and all(torch.equal(run, straight) for run in resumed)
        assert state["warmup_buckets"] == [[0, 1, 2, 3], [4, 5], [6, 7]]  # as DDP rebuilt them
        assert state["warmup_quantizer"]["buckets"] == state["warmup_buckets"]
        assert caught == []
    averager = commhooks.StreamingDiLoCo(sync_every=4, fragments=2, warmup_steps=4, warmup_bits=4)
    for bad in ([[0, 1], [1, 2]], [[0, -1]], "0,1", [[]]):
        with pytest.raises(commhooks.StateDictError, match="'warmup_buckets'"):
            averager.load_state_dict({**state, "warmup_buckets": bad})


def _groups_made_after_unpickling(rank, world_size):
    """Quantized syncs of 4 fragments, then the averager pickled and unpickled onto a new DDP
    model: the groups its next round of syncs makes, and whether the three runs agree."""
    from commhooks.comm import groups

    data = batches(rank, 12)
    ddp = make_ddp(make_mlp(), bucket_cap_mb=0.004)
    diloco = commhooks.register(ddp, "streaming_diloco", sync_every=4, fragments=4, bits=4)
    inner = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    diloco.attach(inner, ddp.module.named_parameters())
    _train(ddp, inner, data[:6])
    model, optimizer = copy.deepcopy(ddp.module.state_dict()), copy.deepcopy(inner.state_dict())
    again, inner_again, resumed = _build_warmup(pickle.loads(pickle.dumps(diloco)))
    again.module.load_state_dict(model)
    inner_again.load_state_dict(optimizer)
    made, subgroup = [], groups.subgroup
    groups.subgroup = lambda ranks, parent: made.append(ranks) or subgroup(ranks, parent)
    try:
        _train(again, inner_again, data[6:])
    finally:
        groups.subgroup = subgroup
    _train(ddp, inner, data[6:])
    return len(made), torch.equal(flat_params(again.module), flat_params(ddp.module))


def test_an_unpickled_averagers_quantized_syncs_share_one_follow_up_group():
    # Each quantized fragment would otherwise make a group of its own (gloo: connections and
    # threads) on its first sync after unpickling.
    for made, same in run_on_ranks(_groups_made_after_unpickling, 2):
        assert made == 1 and same


def test_a_save_after_ddps_first_step_warns_that_the_resume_is_not_bitwise():
    for runs, state, caught in run_on_ranks(_resume_in_warmup, 2, 1):
        assert state["warmup_buckets"] == []  # DDP's first bucket: not the ones it keeps
        assert not torch.equal(runs[1], runs[0])  # what the warning says
        assert len(caught) == 1 and "saved after the first step of its DDP model" in caught[0]
        assert "Save after a later step" in caught[0]
