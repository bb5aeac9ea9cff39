"""PowerSGD's parts, each in one process without a process group: its options, the lazy error
memory, the factor memory, the plan, the state-dict codec, and the checks a hook makes before
its first collective."""

import inspect
import io
import logging
import math
import warnings

import pytest
import torch
from ddp_utils import FakeBucket

from commhooks import PowerSGDState, batched_powerSGD_hook, config, powerSGD_hook
from commhooks.compress.error_feedback import ErrorFeedback
from commhooks.compress.factors import FactorMemory
from commhooks.hooks.powersgd import PowerSGDOptions
from commhooks.hooks.powersgd.plan import Plan, bucket_order
from commhooks.state import StateDictError

pytestmark = pytest.mark.timeout(60)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# -- options --------------------------------------------------------------------------------------
def test_the_state_signature_is_pytorchs_and_its_options_are_spelled_once():
    params = list(inspect.signature(PowerSGDState).parameters.values())[1:]  # after the group
    assert [p.name for p in params] == list(PowerSGDOptions.names())
    assert {p.name: p.default for p in params} == PowerSGDOptions.defaults()
    assert all(PowerSGDOptions.reason(name) for name in PowerSGDOptions.names())
    state = PowerSGDState(None, 2, 10)  # positionally, as PyTorch's state takes them
    assert isinstance(state.settings, PowerSGDOptions)
    assert state.options() == state.settings.as_dict()
    for name in PowerSGDOptions.names():  # PyTorch's attributes read the typed options
        assert getattr(state, name) == getattr(state.settings, name)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter) == (2, 10)


def test_options_are_fixed_once_the_state_is_built():
    state = PowerSGDState(None)
    with pytest.raises(AttributeError, match=r"build a new PowerSGDState\(\.\.\., warm_start="):
        state.warm_start = False
    assert state.warm_start is True


def test_register_derives_names_and_checks_from_the_options_class():
    spec = config.hook_spec("power_sgd_single_round")
    assert spec.settings is PowerSGDOptions and spec.fixed == {"single_round": True}
    assert spec.options == frozenset(PowerSGDOptions.names()) - {"single_round"}
    assert spec.make_state(None, {}).single_round
    # Values are checked when the configuration is built, with the options' own message.
    with pytest.raises(ValueError, match="matrix_approximation_rank must be an integer >= 1"):
        config.HookConfig("power_sgd", options={"matrix_approximation_rank": 0})
    with pytest.raises(ValueError, match="single_round=True needs warm_start=True"):
        config.HookConfig("power_sgd_single_round", options={"warm_start": False})


# -- the lazy error memory ---------------------------------------------------------------------
def test_a_memory_keeps_the_new_errors_only_where_the_step_was_finite():
    memory = ErrorFeedback("DemoState")
    old = torch.arange(6.0).view(2, 3)
    memory.record(0, old.clone())
    new = torch.full((2, 3), 7.0)
    memory.record_where(torch.tensor(False), [0, 1], [new, new])
    # Not finite: the old residual stays, and a key without one gets zeros, not the new errors.
    assert torch.equal(memory.get(0, old), old) and torch.equal(memory.get(1, old), old * 0)
    kept = memory.get(0, old)
    memory.record_where(torch.tensor(True), [0], [new])
    assert torch.equal(memory.get(0, old), new) and memory.get(0, old) is kept  # in place


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_a_memorys_choice_is_exact_for_every_value_and_leaves_the_errors_alone(dtype):
    # A large residual on a CPU is chosen on its bits: every value, the sign of zero included,
    # must come out as torch.where gives it, and the errors handed in must stay as they were.
    special = [math.inf, -math.inf, math.nan, -0.0, 0.0, 1e-40, -3.5, 65504.0, 1.0, 2.0]
    old = torch.tensor(special * 8000, dtype=dtype).view(400, 200)  # 80,000 elements
    new = old.roll(3).neg().t().contiguous().t()  # not contiguous: a column view of a stack
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[old.element_size()]
    for finite in (True, False):
        memory = ErrorFeedback("DemoState")
        memory.record(0, old.clone())
        errors = new.clone()
        memory.record_where(torch.tensor(finite), [0], [errors])
        want = torch.where(torch.tensor(finite), new, old)
        assert torch.equal(memory.get(0, old).view(bits), want.view(bits)), finite
        assert torch.equal(errors.view(bits), new.view(bits))


def test_factor_memory_warm_start_alternation_and_state_dict():
    factors = FactorMemory("DemoState", describe=lambda key: f"matrix {key}")
    assert factors.next_step(0) == "p"
    q_t = torch.ones(2, 5)  # Q stored as the transpose of a contiguous Qᵀ
    factors.keep(0, torch.ones(4, 2), q_t.t(), "p")
    assert factors.next_step(0) == "q" and factors.start("q", 0, (5, 2), q_t) is not None
    saved = factors.state_dict()
    assert saved["q"]["0"].is_contiguous() and saved["last_step"] == {"0": "p"}
    with pytest.warns(UserWarning, match=r"\(5, 2\) for matrix 0 does not fit .* needs \(6, 2\)"):
        assert factors.start("q", 0, (6, 2), q_t) is None
    other = FactorMemory("DemoState")
    other.load_state_dict({**saved, "q": {"0": torch.ones(5, 2).t().t()}}, int)
    bad = {**saved, "p": {"0": torch.ones(4)}}
    with pytest.raises(StateDictError, match=r"p\['0'\] must be a 2-D factor"):
        other.load_state_dict(bad, int)
    with pytest.raises(StateDictError, match=r"last_step\['0'\] must be 'p' or 'q'"):
        other.load_state_dict({**saved, "last_step": {"0": "x"}}, int)
    assert other.next_step(0) == "q"  # a refused dict changed nothing


# -- the plan ----------------------------------------------------------------------------------
def test_plan_compresses_matrices_that_gain_grouped_by_shape():
    grads = [torch.zeros(16, 12), torch.zeros(12), torch.zeros(20, 6), torch.zeros(16, 12)]
    plan = Plan.build((3, 2, 1, 0), grads, rank=1, min_rate=2)
    assert [c[:2] for c in plan.compressed] == [(0, 3), (3, 0), (2, 1)]
    assert plan.uncompressed == (1,)
    assert plan.numel_before == 2 * 192 + 12 + 120
    assert plan.numel_after == 2 * 28 + 12 + 26
    layouts: dict[str, tuple[int, ...]] = {}
    assert bucket_order(layouts, "bucket0", (2, 0, 1)) == (None, False)
    assert bucket_order(layouts, "bucket0", (0, 1, 2)) == ([2, 0, 1], False)
    assert bucket_order(layouts, "bucket0", (0, 1)) == (None, True) and layouts["bucket0"] == (0, 1)


# -- the state dict ----------------------------------------------------------------------------
def _saved(**memories):
    """A layer-wise state dict whose memories are ``memories`` (entry name -> {key: tensor})."""
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0)
    sd = state.state_dict()
    sd["error"] = {"0": torch.ones(6, 4), "1": torch.ones(4)}
    sd["q"] = {"0": torch.ones(4, 2)}
    for name, entries in memories.items():
        sd[name] = {**sd[name], **entries}
    return sd


def test_a_state_dict_round_trips_and_keeps_its_hook():
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0)
    state.load_state_dict(_saved())
    assert state.hook_name == "powerSGD_hook"  # told by its per-parameter keys
    again = state.state_dict()
    assert again["hook"] == "powerSGD_hook" and torch.equal(again["q"]["0"], torch.ones(4, 2))


@pytest.mark.parametrize(
    ("memories", "words"),
    [
        ({"error": {"0": torch.full((6, 4), math.nan)}}, r"error\['0'\] holds inf or NaN"),
        ({"q": {"0": torch.tensor([[1.0, math.inf]] * 4)}}, r"q\['0'\] holds inf or NaN"),
        ({"p": {"0": torch.ones(5, 2)}}, r"key '0' do not fit .*error \(6, 4\), p \(5, 2\)"),
        ({"q": {"0": torch.ones(5, 2)}}, r"key '0' do not fit .*q \(5, 2\)"),
        ({"q": {"0": torch.ones(4, 3)}}, r"key '0' do not fit .*matrix_approximation_rank=2"),
        ({"q": {"0": torch.ones(4, 1)}}, r"r = min\(rank, n, m\)"),
        ({"q": {"0": torch.ones(4, 2, dtype=torch.float64)}}, r"of one dtype"),
        ({"error": {"0": torch.ones(6, 4).t()}}, r"error\['0'\] must be a dense, contiguous"),
        ({"error": {"x": torch.ones(2)}}, r"'x' is not a valid key"),
        ({"last_step": {"1": "p"}}, r"last_step\['1'\] has no factors"),
    ],
)
def test_a_state_dict_whose_tensors_do_not_fit_is_refused_naming_the_entry(memories, words):
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0)
    with pytest.raises(StateDictError, match=f"malformed PowerSGD state dict.*{words}"):
        state.load_state_dict(_saved(**memories))
    assert len(state.memory) == 0 and state.hook_name is None  # nothing changed


def test_a_small_file_whose_tensor_claims_a_billion_elements_is_refused():
    sd = _saved(error={"0": torch.zeros(1).expand(10**9)})
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    assert buffer.tell() < 20_000
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    with pytest.raises(StateDictError, match=r"error\['0'\] must be a dense"):
        PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0).load_state_dict(
            loaded
        )


def _broken(what):
    sd = _saved()
    where, _, value = what
    if where in ("rng.pos", "rng.keys"):
        sd["rng"] = {**sd["rng"], where[4:]: value}
    else:
        sd[where] = value
    return sd


@pytest.mark.parametrize(
    "what",
    [
        ("world_size", "an integer", math.inf),
        ("rank", "an integer", math.inf),
        ("rank", "an integer", 1.5),
        ("rng.pos", "an integer", math.inf),
        ("rng.keys", "must be of dtype", torch.zeros(624, dtype=torch.float32)),
        ("iter", "an integer", math.nan),
        ("error", "must be a mapping", [torch.ones(2)]),
        ("error", "must be a mapping", None),
        ("q", "must be a mapping", "q"),
        ("last_step", "must be a mapping", 3),
        ("layouts", "must be a mapping", [1, 2]),
        ("hook", "hook must be one of", "allreduce_hook"),
        ("rng", "rng must be a mapping", 7),
    ],
)
def test_malformed_containers_raise_state_dict_error(what):
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0)
    with pytest.raises(StateDictError, match=f"malformed PowerSGD state dict.*{what[1]}"):
        state.load_state_dict(_broken(what))


@pytest.mark.parametrize("version", [0, -1, True, "2", 2.0, None])
def test_a_version_that_is_not_a_positive_integer_is_refused(version):
    sd = {**PowerSGDState(None).state_dict(), "version": version}
    with pytest.raises(StateDictError, match="version must be a positive integer"):
        PowerSGDState(None).load_state_dict(sd)


def test_a_state_of_one_hook_is_refused_by_a_state_that_knows_the_other():
    state = config.hook_spec("batched_power_sgd").make_state(
        None, {"matrix_approximation_rank": 2, "start_powerSGD_iter": 0}
    )
    with pytest.raises(StateDictError, match="belongs to powerSGD_hook .* used by batched_power"):
        state.load_state_dict(_saved())
    assert state.hook_name == "batched_powerSGD_hook"


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook])
def test_a_state_of_one_hook_is_refused_at_the_first_step_of_the_other(hook):
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0)
    sd = _saved()
    if hook is powerSGD_hook:  # a batched state: per-bucket keys
        sd["error"], sd["q"] = {"bucket0": torch.ones(6, 6)}, {"bucket0": torch.ones(6, 2)}
        sd["hook"] = "batched_powerSGD_hook"
    state.load_state_dict(sd)
    other = "batched_powerSGD_hook" if hook is powerSGD_hook else "powerSGD_hook"
    # Refused before any collective: no process group is needed to find out.
    with pytest.raises(StateDictError, match=f"belongs to {other} .* now used by {hook.__name__}"):
        hook(state, FakeBucket([torch.ones(6, 4)]))


# -- before the first collective ---------------------------------------------------------------
class _SparseBucket(FakeBucket):
    def __init__(self):
        super().__init__([])
        self._buffer = torch.sparse_coo_tensor([[0, 3]], [1.0, 2.0], (8,), check_invariants=True)


@pytest.mark.parametrize("hook", [powerSGD_hook, batched_powerSGD_hook])
def test_a_sparse_bucket_is_refused_naming_the_hook_to_use(hook):
    with pytest.raises(TypeError, match="sparse gradient .* Register commhooks.allreduce_hook"):
        hook(PowerSGDState(None), _SparseBucket())


def test_compression_start_is_logged_once_at_info(caplog):
    caplog.set_level(logging.INFO, logger="commhooks.hooks.powersgd")
    for start in (0, 3):
        caplog.clear()
        state, compressed = PowerSGDState(None, start_powerSGD_iter=start), []
        for _ in range(6):
            compressed.append(state.compressing())
            state.maybe_increase_iter(FakeBucket([torch.zeros(1)], last=True))
        assert compressed == [step >= start for step in range(6)]
        started = [r for r in caplog.records if "compressing from step" in r.getMessage()]
        assert len(started) == 1 and started[0].levelno == logging.INFO
        assert f"from step {start} on (start_powerSGD_iter={start}" in started[0].getMessage()


def test_a_state_dict_without_memory_past_its_start_still_warns():
    sd = {**_saved(), "iter": 5, "error": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0).load_state_dict(sd)
    assert any("holds no error-feedback memory" in str(w.message) for w in caught)
    assert all(w.filename == __file__ for w in caught)  # said where the user loaded it
