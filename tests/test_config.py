"""One-line configuration: names, validation, the mapping form, and every hook x wrapper."""

import enum
import json
import os

import pytest
import torch
import torch.distributed as dist
from ddp_utils import batches, flat_params, make_ddp, make_mlp, train

import commhooks
from commhooks import comm, config
from commhooks.config import CommHookType, HookConfig, hook_names, register, wrapper_names
from commhooks.state import HookState
from commhooks.testing import run_on_ranks

# Options that make the stateful hooks do their real work within a few steps; only those a
# registered hook takes are used, so hooks added later are covered as soon as they exist.
FAST_OPTIONS = {"start_powerSGD_iter": 2, "start_localSGD_iter": 2, "sync_every": 2}
# Hooks that, by design, leave the ranks' models different.
UNSYNCED = {"noop", "post_local_sgd", "diloco", "streaming_diloco"}
STEPS = 4


def fast_options(hook: str) -> dict:
    spec = config.hook_spec(hook)
    return {k: v for k, v in FAST_OPTIONS.items() if k in spec.options}


# Quantized hooks refuse a cast wrapper (see test_quantized_hooks_refuse_cast_wrappers).
UNWRAPPED = ("int8", "int4")


def combinations() -> list[tuple[str, str]]:
    return [
        (h, w)
        for h in hook_names()
        if h != "no"
        for w in wrapper_names()
        if w == "no" or h not in UNWRAPPED
    ]


def test_quantized_hooks_refuse_cast_wrappers():
    for hook in UNWRAPPED:
        assert hook in hook_names()
        for wrapper in ("fp16", "bf16"):
            with pytest.raises(ValueError, match=f"'{hook}' does not take wrapper '{wrapper}'"):
                HookConfig(hook, wrapper)
        assert HookConfig(hook.upper(), "no", {"block_size": 64}).options == {"block_size": 64}
    with pytest.raises(ValueError, match="use hook 'int4' instead"):
        HookConfig("int8", options={"bits": 4})


# -- names and validation (no processes needed) -------------------------------------------------
def test_names_accept_enum_and_any_case():
    assert HookConfig("FP16").hook is CommHookType.FP16
    assert HookConfig(CommHookType.ALLREDUCE, "Bf16").wrapper is CommHookType.BF16
    assert HookConfig("allreduce", None).wrapper is CommHookType.NO
    assert {"no", "fp16", "bf16", "allreduce", "noop"} <= set(hook_names())

    class AccelerateStyle(str, enum.Enum):  # what Accelerate's DDPCommunicationHookType is
        FP16 = "fp16"

    assert HookConfig(AccelerateStyle.FP16).hook is CommHookType.FP16


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"hook": "fp61"}, ["unknown hook 'fp61'", "Did you mean 'fp16'", "allreduce"]),
        ({"hook": "fp16", "wrapper": "bf61"}, ["unknown wrapper", "'bf16'", "no, fp16, bf16"]),
        ({"hook": "fp16", "wrapper": "allreduce"}, ["unknown wrapper", "no, fp16, bf16"]),
        ({"hook": "no", "wrapper": "fp16"}, ["needs a hook to wrap", "hook='allreduce'"]),
    ],
)
def test_invalid_names_list_the_valid_ones(kwargs, expected):
    with pytest.raises(ValueError) as err:
        HookConfig(**kwargs)
    for text in expected:
        assert text in str(err.value)


def test_hook_must_be_a_name():
    with pytest.raises(TypeError, match="register_comm_hook"):
        HookConfig(commhooks.allreduce_hook)


def test_unknown_option_lists_what_the_hook_takes():
    for hook in hook_names():
        spec = config.hook_spec(hook)
        with pytest.raises(ValueError) as err:
            HookConfig(hook, options={"not_an_option": 1})
        message = str(err.value)
        assert "not_an_option" in message and f"'{hook}'" in message
        for option in spec.options:
            assert option in message


def test_typo_in_an_option_suggests_the_nearest():
    for hook in hook_names():
        for option in config.hook_spec(hook).options:
            typo = option[:-1] + ("x" if option[-1] != "x" else "y")
            with pytest.raises(ValueError, match=f"Did you mean '{option}'"):
                HookConfig(hook, options={typo: 1})


def test_option_of_another_hook_names_the_hooks_that_take_it():
    all_options = {o for h in hook_names() for o in config.hook_spec(h).options}
    checked = 0
    for hook in hook_names():
        for option in sorted(all_options - config.hook_spec(hook).options):
            with pytest.raises(ValueError) as err:
                HookConfig(hook, options={option: 1})
            message = str(err.value)
            assert "does not apply" in message
            assert all(h in message for h in config.hooks_taking(option))
            checked += 1
    # With only stateless hooks registered there is nothing to misplace; a fake table shows
    # the message all the same.
    assert checked or not all_options


@pytest.mark.parametrize(
    ("hook", "option", "expected"),
    [
        ("batched_power_sgd", "min_compression_rate", ["no per-matrix threshold"]),
        ("batched_power_sgd", "batch_tensors_with_same_shape", ["nothing to batch"]),
        ("power_sgd_single_round", "single_round", ["Use hook 'power_sgd' instead"]),
    ],
)
def test_powersgd_hooks_refuse_the_options_they_would_ignore(hook, option, expected):
    assert option not in config.hook_spec(hook).options
    for value in (False, True, 1):
        with pytest.raises(ValueError) as err:
            HookConfig(hook, options={option: value})
        message = str(err.value)
        assert f"option '{option}' does not apply to hook '{hook}'" in message
        assert "it is an option of: " in message and "power_sgd" in config.hooks_taking(option)
        for text in [*expected, *config.hooks_taking(option)]:
            assert text in message
    with pytest.raises(ValueError, match="does not apply"):
        HookConfig.from_dict({"comm_hook": hook, "comm_state_option": {option: False}})


def test_powersgd_hooks_take_the_options_they_use():
    takes = {h: config.hook_spec(h).options for h in hook_names() if "power_sgd" in h}
    assert {"min_compression_rate", "batch_tensors_with_same_shape"} <= takes["power_sgd"]
    assert takes["batched_power_sgd"] == takes["power_sgd"] - {
        "min_compression_rate",
        "batch_tensors_with_same_shape",
    }
    assert takes["power_sgd_single_round"] == takes["power_sgd"] - {"single_round"}
    options = {"matrix_approximation_rank": 2, "single_round": True, "random_seed": 3}
    cfg = HookConfig("batched_power_sgd", "fp16", options)
    assert HookConfig.from_dict(cfg.to_dict()) == cfg
    state = config.hook_spec("power_sgd_single_round").make_state(None, {"warm_start": True})
    assert state.single_round


def test_misplaced_option_message_with_a_stateful_hook(monkeypatch):
    specs = config._specs()
    specs[CommHookType.POWER_SGD] = config.HookSpec(
        commhooks.allreduce_hook, lambda g, o: None, frozenset({"matrix_approximation_rank"})
    )
    monkeypatch.setattr(config, "_specs", lambda: specs)
    with pytest.raises(ValueError) as err:
        HookConfig("fp16", options={"matrix_approximation_rank": 2})
    assert "does not apply to hook 'fp16'" in str(err.value)
    assert "power_sgd" in str(err.value)


# -- the mapping form -----------------------------------------------------------------------
def test_mapping_round_trip_for_every_hook_and_wrapper():
    for hook, wrapper in combinations():
        d = {"hook": hook.upper(), "wrapper": wrapper, **fast_options(hook)}
        cfg = HookConfig.from_dict(d)
        normalised = {"hook": hook, "wrapper": wrapper, **fast_options(hook)}
        assert cfg.to_dict() == normalised
        assert HookConfig.from_dict(cfg.to_dict()) == cfg
        assert HookConfig.from_json(cfg.to_json()) == cfg
        assert json.loads(cfg.to_json()) == normalised


def test_mapping_forms_agree():
    hook = next((h for h in hook_names() if fast_options(h)), "allreduce")
    opts = fast_options(hook)
    flat = HookConfig.from_dict({"hook": hook, "wrapper": "fp16", **opts})
    nested = HookConfig.from_dict({"hook": hook, "wrapper": "fp16", "options": opts})
    accel = HookConfig.from_dict(
        {"comm_hook": hook, "comm_wrapper": "fp16", "comm_state_option": opts}
    )
    assert flat == nested == accel
    assert HookConfig.from_dict({"hook": "fp16"}).to_dict() == {"hook": "fp16", "wrapper": "no"}


def test_mapping_errors():
    with pytest.raises(ValueError, match="no 'hook' entry; valid hooks: no, allreduce"):
        HookConfig.from_dict({"wrapper": "fp16"})
    with pytest.raises(ValueError, match="given twice"):
        HookConfig.from_dict({"hook": "fp16", "comm_hook": "bf16"})
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        HookConfig.from_dict({"hook": "fp16", "bogus": 3})
    with pytest.raises(ValueError, match="pass it to register"):
        HookConfig.from_dict({"hook": "allreduce", "process_group": None})


def test_yaml_round_trip():
    yaml = pytest.importorskip("yaml")
    for hook, wrapper in combinations():
        cfg = HookConfig(hook, wrapper, fast_options(hook))
        text = cfg.to_yaml()
        assert yaml.safe_load(text) == cfg.to_dict()
        assert HookConfig.from_yaml(text) == cfg
    assert HookConfig.from_yaml("hook: BF16\nwrapper: no\n").hook is CommHookType.BF16


# -- backend checks ---------------------------------------------------------------------------
def test_bf16_backend_check(monkeypatch):
    def check(backend, nccl=(2, 18, 1)):
        monkeypatch.setattr(comm, "backend_for_device", lambda group, device: backend)
        monkeypatch.setattr(config, "_nccl_version", lambda: nccl)
        config._check_bf16(None, "cpu")

    check("gloo")
    check("nccl")
    with pytest.raises(ValueError, match=r"NCCL 2.10 or newer.*2\.8\.4.*'fp16'"):
        check("nccl", (2, 8, 4))
    for backend in ("mpi", "ucc"):
        with pytest.raises(ValueError, match=f"'{backend}' backend.*'fp16'"):
            check(backend)


def test_backend_for_device_reads_per_device_backends(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert comm.backend_for_device(None, "cpu") == "gloo"
    assert comm.backend_for_device(None, "cuda") == "nccl"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert comm.backend_for_device(None, "cuda") == "gloo"


def _bf16_steps(rank, world_size):
    ddp = make_ddp(make_mlp())
    commhooks.register(ddp, "bf16")
    train(ddp, batches(rank, 2))
    return str(dist.get_backend()), flat_params(ddp.module)


def test_a_group_initialised_without_a_backend_is_read_by_its_devices_backends():
    # init_process_group() with no backend reports "undefined"; its CPU backend is gloo,
    # which allreduces bfloat16: the hook is taken, with gloo's bits.
    (name, unnamed), _ = run_on_ranks(_bf16_steps, 2, backend=None)
    (_, named), _ = run_on_ranks(_bf16_steps, 2)
    assert name == "undefined" and torch.equal(unnamed, named)


# -- registration on 2 ranks -----------------------------------------------------------------
def _every_combination(rank, world_size):
    initial = flat_params(make_mlp())
    out = {}
    data = batches(rank, STEPS)
    for hook, wrapper in combinations():
        ddp = make_ddp(make_mlp())
        state = register(ddp, hook, wrapper, **fast_options(hook))
        train(ddp, data)
        params = flat_params(ddp.module)
        out[hook, wrapper] = {
            "params": params,
            "finite": bool(torch.isfinite(params).all()),
            "moved": not torch.equal(params, initial),
            "state_type": type(state).__name__,
            "hook_state": isinstance(state, HookState),
            "state_dict": state.state_dict() if isinstance(state, HookState) else None,
        }
    return out


def test_register_every_hook_and_wrapper_trains_and_returns_the_state():
    results = run_on_ranks(_every_combination, 2)
    assert set(results[0]) == set(combinations())
    for (hook, wrapper), r0 in results[0].items():
        r1 = results[1][hook, wrapper]
        assert r0["finite"] and r0["moved"], (hook, wrapper)
        if not config.HookConfig(hook, options=fast_options(hook)).stateful:
            assert r0["state_type"] == "StatelessState"
            assert r0["state_dict"] == {"kind": "stateless", "version": 1}
        else:
            assert r0["hook_state"], f"{hook} returned {r0['state_type']}, not its HookState"
            assert r0["state_dict"]["kind"]
        if hook not in UNSYNCED:
            assert torch.equal(r0["params"], r1["params"]), f"{hook}/{wrapper}: ranks diverged"
    # noop communicates nothing: different data on each rank gives different models.
    assert not torch.equal(results[0]["noop", "no"]["params"], results[1]["noop", "no"]["params"])


def _late_failures(rank, world_size):
    messages = {}
    ddp = make_ddp(make_mlp())
    register(ddp, "allreduce")
    for name, call in {
        "twice": lambda: register(ddp, "fp16"),
        "twice_plain": lambda: register(
            make_ddp(make_mlp(), commhooks.allreduce_hook), "allreduce"
        ),
        "not_ddp": lambda: register(make_mlp(), "fp16"),
    }.items():
        try:
            call()
        except (ValueError, TypeError) as exc:
            messages[name] = f"{type(exc).__name__}: {exc}"
    only_rank0 = dist.new_group([0])
    try:
        register(make_ddp(make_mlp()), "allreduce", process_group=only_rank0)
        messages["group"] = "accepted"
    except ValueError as exc:
        messages["group"] = str(exc)
    # 'no' keeps DDP's own allreduce and registers nothing.
    plain = make_ddp(make_mlp())
    messages["no"] = type(register(plain, "no")).__name__
    messages["no_hooks"] = len(getattr(plain, "_comm_hooks", []))
    # Without a process_group, the hook communicates on the DDP model's own group.
    group = dist.new_group([0, 1])
    own = register(make_ddp(make_mlp(), process_group=group), "fp16")
    messages["own_group"] = own.process_group is group
    messages["same_from_config"] = _from_config(rank)
    return messages


def _from_config(rank):
    data = batches(rank, 3)
    a, b, c = (make_ddp(make_mlp()) for _ in range(3))
    config.register_from_config(a, {"hook": "allreduce", "wrapper": "bf16"})
    config.register_from_config(b, HookConfig("allreduce", "bf16"))
    register(c, **HookConfig("allreduce", "bf16").to_dict())
    for m in (a, b, c):
        train(m, data)
    pa, pb, pc = (flat_params(m.module) for m in (a, b, c))
    return torch.equal(pa, pb) and torch.equal(pa, pc)


def test_choices_that_would_fail_later_are_caught_at_registration():
    """And the DDP model's group is the default; the mapping forms register the same hook."""
    results = run_on_ranks(_late_failures, 2)
    for m in results:
        assert "already has a communication hook" in m["twice"]
        assert "only one per model" in m["twice"]
        assert "already has a communication hook" in m["twice_plain"]
        assert (
            m["not_ddp"].startswith("TypeError")
            and "DistributedDataParallel(model)" in m["not_ddp"]
        )
        assert m["no"] == "StatelessState" and m["no_hooks"] == 0
        assert m["own_group"] and m["same_from_config"]
    # A hook group other than the DDP model's is refused on every rank, before anything is sent.
    refused = results[0]["group"]
    assert "holds global ranks [0], but the DDP model synchronises ranks [0, 1]" in refused
    assert "not a member" in results[1]["group"]


def _checkpoint_what_register_returns(rank, world_size, directory):
    out = {}
    for hook in hook_names():
        ddp = make_ddp(make_mlp())
        state = register(ddp, hook, **fast_options(hook))
        train(ddp, batches(rank, STEPS))
        path = os.path.join(directory, f"{hook}-{rank}.pt")
        commhooks.checkpoint.save(path, hook=state)
        fresh = register(make_ddp(make_mlp()), hook, **fast_options(hook))
        commhooks.checkpoint.load(path, hook=fresh)
        entry = commhooks.checkpoint.read(path)["hook"]
        out[hook] = (type(state).__name__, entry["kind"], entry["version"], len(entry))
    # A stateless hook's entry is no other hook's state.
    power = register(make_ddp(make_mlp()), "power_sgd")
    try:
        commhooks.checkpoint.load(os.path.join(directory, f"fp16-{rank}.pt"), hook=power)
        out["mismatch"] = "loaded"
    except commhooks.checkpoint.CheckpointError as exc:
        out["mismatch"] = str(exc)
    return out


def test_checkpoint_saves_whatever_register_returned(tmp_path):
    for out in run_on_ranks(_checkpoint_what_register_returns, 2, str(tmp_path)):
        assert "'stateless' state" in out.pop("mismatch")
        for hook, (state_type, kind, version, keys) in out.items():
            if not config.HookConfig(hook, options=fast_options(hook)).stateful:
                # an empty, versioned entry; 'no' registers nothing and saves the same
                assert (state_type, kind, version, keys) == ("StatelessState", "stateless", 1, 2)
            else:
                assert state_type != "StatelessState" and kind != "stateless", hook


def test_yaml_refuses_a_key_given_twice_with_the_file_name_and_line(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "hook.yaml"
    path.write_text("hook: power_sgd\nmatrix_approximation_rank: 2\nmatrix_approximation_rank: 4\n")
    with open(path) as f, pytest.raises(ValueError, match=r"hook.yaml, line 3: key 'matrix_"):
        HookConfig.from_yaml(f)
    text = "hook: fp16\noptions:\n  x: 1\n  x: 2\n"
    with pytest.raises(ValueError, match=r"^cfg.yml, line 4: .*first on line 3"):
        HookConfig.from_yaml(text, name="cfg.yml")
    assert HookConfig.from_yaml(path.read_text().rsplit("\n", 2)[0]).options == {
        "matrix_approximation_rank": 2
    }


@pytest.mark.parametrize("opening", ["{", "["])
def test_yaml_refuses_deep_nesting_with_the_file_name_and_line(tmp_path, opening):
    pytest.importorskip("yaml")
    path = tmp_path / "deep.yaml"
    path.write_text("hook: fp16\nx: " + opening * 5000 + "\n")
    with open(path) as f, pytest.raises(ValueError, match=r"deep.yaml, line 2: .*nested"):
        HookConfig.from_yaml(f)


def test_post_local_sgds_values_are_checked_when_the_config_is_built():
    def built(**options):
        return HookConfig("post_local_sgd", options={"start_localSGD_iter": 2, **options})

    assert built(subgroup=None).options == {"start_localSGD_iter": 2, "subgroup": None}
    with pytest.raises(ValueError, match="start_localSGD_iter must be >= 0"):
        built(start_localSGD_iter=-5)
    with pytest.raises(ValueError, match="post_local_gradient_allreduce must be True or False"):
        built(post_local_gradient_allreduce="yes")
    with pytest.raises(TypeError, match="'subgroup' must be a ProcessGroup or None.*got str"):
        built(subgroup="machine")


def test_yaml_reads_a_bare_no_as_the_hook_no_and_refuses_options_that_are_not_a_mapping():
    assert HookConfig.from_yaml("hook: no\n").hook is CommHookType.NO
    assert HookConfig.from_yaml("hook: fp16\nwrapper: no\n").wrapper is CommHookType.NO
    assert HookConfig.from_yaml("hook: fp16\noptions:\n").options == {}
    for text in ("hook: fp16\noptions: []\n", "hook: fp16\noptions: ''\n"):
        with pytest.raises(TypeError, match="'options' must be a mapping"):
            HookConfig.from_yaml(text)
    with pytest.raises(TypeError, match="wrapper must be a CommHookType or its name"):
        HookConfig.from_yaml("hook: fp16\nwrapper: 0\n")
