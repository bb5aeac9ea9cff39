"""What a configuration refuses, by every route it reaches a state: an integer option given as
a float (``bits: 4.0``), and a YAML or JSON text that is not a mapping."""

import dataclasses

import pytest

import commhooks
from commhooks.options import Options


def _optional_integer_options():
    """Every ``int | None`` option of every options class of the package."""
    found, todo = [], [Options]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    for cls in found:
        if not cls.__module__.startswith("commhooks"):
            continue
        for f in dataclasses.fields(cls):
            if str(f.type).replace(" ", "") in ("int|None", "typing.Optional[int]"):
                yield cls, f.name


_REQUIRED = {"sync_every": 4}


@pytest.mark.parametrize(
    ("cls", "name"), list(_optional_integer_options()), ids=lambda v: getattr(v, "__name__", v)
)
def test_every_optional_integer_option_refuses_a_float_naming_the_fix(cls, name):
    base = {n: _REQUIRED[n] for n in cls.required()}
    with pytest.raises(ValueError, match=rf"{name} must be an integer \(8 without the point\)"):
        cls(**{**base, name: 8.0})
    assert getattr(cls(**{**base, name: 8}), name) == 8
    assert getattr(cls(**{**base, name: None}), name) is None


def test_float_bits_are_refused_by_every_route():
    says = r"bits must be an integer \(4 without the point\)"
    for name in ("bits", "warmup_bits"):
        with pytest.raises(ValueError, match=f"{name} {says[5:]}"):
            commhooks.StreamingDiLoCo(sync_every=4, **{name: 4.0})
    with pytest.raises(ValueError, match=says):
        commhooks.HookConfig.from_dict({"hook": "streaming_diloco", "sync_every": 4, "bits": 4.0})
    with pytest.raises(ValueError, match=says):
        commhooks.HookConfig.from_yaml("hook: streaming_diloco\nsync_every: 4\nbits: 4.0\n")
    with pytest.raises(ValueError, match=says):  # before the model is even looked at
        commhooks.register(object(), "streaming_diloco", sync_every=4, bits=4.0)
    accelerate = pytest.importorskip("commhooks.integrations.accelerate")
    pytest.importorskip("accelerate")
    with pytest.raises(ValueError, match=says):
        accelerate.DistributedDataParallelKwargs(
            comm_hook="streaming_diloco", comm_state_option={"sync_every": 4, "bits": 4.0}
        )
    good = commhooks.HookConfig.from_dict({"hook": "streaming_diloco", "sync_every": 4, "bits": 4})
    assert "bits: 4\n" in good.to_yaml()


@pytest.mark.parametrize("text", ["- hook: fp16\n- wrapper: no\n", "fp16\n", "", "# nothing\n"])
def test_yaml_that_is_not_a_mapping_is_a_value_error_naming_the_fix(text):
    pytest.importorskip("yaml")
    with pytest.raises(ValueError, match=r"cfg\.yml: a hook configuration in YAML is one mapping"):
        commhooks.HookConfig.from_yaml(text, name="cfg.yml")


def test_json_that_is_not_an_object_is_a_value_error_naming_the_fix():
    for text in ('["fp16"]', '"fp16"', "null"):
        with pytest.raises(ValueError, match=r'one mapping of names to values, e\.g\. \{"hook"'):
            commhooks.HookConfig.from_json(text)
    with pytest.raises(TypeError, match="expects a mapping"):  # a Python object: its type
        commhooks.HookConfig.from_dict(["fp16"])


def test_a_config_holding_a_process_group_is_refused_by_json_and_yaml_naming_the_option():
    # json.dumps raised "Object of type ProcessGroup is not JSON serializable", naming nothing.
    import torch.distributed as dist

    group = dist.ProcessGroup(dist.HashStore(), 0, 1)  # no process group initialised
    options = {"subgroup": group, "start_localSGD_iter": 2}
    config = commhooks.HookConfig("post_local_sgd", options=options)
    for save, form in ((config.to_json, "JSON"), (config.to_yaml, "YAML")):
        with pytest.raises(ValueError) as caught:
            save()
        assert f"option 'subgroup' holds a ProcessGroup, which {form} cannot hold" in str(
            caught.value
        )
        assert "register(ddp_model, **config.to_dict(), subgroup=...)" in str(caught.value)
