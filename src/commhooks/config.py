"""One-line configuration: ``commhooks.register(ddp_model, "power_sgd", wrapper="fp16")``.

Names follow Hugging Face Accelerate's ``DDPCommunicationHookType`` (``no``, ``fp16``, ``bf16``,
``power_sgd``, ``batched_power_sgd``) plus the package's own. Everything is validated before
anything is registered: an unknown name or option, or an option that the chosen hook does not
take, raises ``ValueError`` listing what is valid, and so do choices that would only fail
later (bf16 on a backend without it, a second hook on the same model, a group this rank is not
in). The same choice loads from a mapping (JSON, YAML) through :class:`HookConfig`.
"""

import contextlib
import json
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import IO, Any

import torch.distributed as dist

from commhooks import comm
from commhooks.options import Options, suggest
from commhooks.state import StatelessOptions, StatelessState

__all__ = [
    "CommHookType",
    "HookConfig",
    "HookSpec",
    "hook_names",
    "hook_spec",
    "hooks_taking",
    "register",
    "register_from_config",
    "wrapper_names",
]


class CommHookType(str, Enum):
    """Names of the hooks and wrappers ``register`` understands (Accelerate's and ours)."""

    NO = "no"
    ALLREDUCE = "allreduce"
    FP16 = "fp16"
    BF16 = "bf16"
    NOOP = "noop"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"
    POWER_SGD_SINGLE_ROUND = "power_sgd_single_round"
    POST_LOCAL_SGD = "post_local_sgd"
    INT8 = "int8"
    INT4 = "int4"
    DILOCO = "diloco"
    STREAMING_DILOCO = "streaming_diloco"

    def __str__(self) -> str:
        return self.value


WRAPPERS = (CommHookType.NO, CommHookType.FP16, CommHookType.BF16)


StateMaker = Callable[[dist.ProcessGroup | None, Mapping[str, Any]], Any]
"""Builds a hook's state from ``(process_group, options)``."""


@dataclass(frozen=True)
class HookSpec:
    """How to build and register one kind of hook; one with an options class is declared with
    :meth:`of`, which derives the rest from that class.

    Attributes:
        make_state: builds the state from ``(process_group, options)``; ``None`` when the state
            is the process group itself.
        options: the option names the hook uses; its state may accept more (the PowerSGD
            hooks share one state class), but an option the hook would ignore is refused.
        notes: for options of related hooks that this one refuses, why, and what to use
            instead; the error message ends with it.
        fixed: options the hook sets itself, which the user may not give.
    """

    hook: Callable[..., Any] | None
    make_state: StateMaker | None = None
    options: frozenset[str] = field(default_factory=frozenset)
    required: frozenset[str] = field(default_factory=frozenset)
    notes: Mapping[str, str] = field(default_factory=dict, compare=False)
    settings: type[Options] | None = None
    fixed: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def of(
        cls,
        hook: Callable[..., Any],
        settings: type[Options],
        make_state: StateMaker,
        fixed: Mapping[str, Any] | None = None,
        notes: Mapping[str, str] | None = None,
    ) -> "HookSpec":
        """The spec of a hook whose options are the fields of ``settings``.

        ``make_state`` receives the ``fixed`` options with the user's; the options in
        ``fixed`` and ``notes`` are refused from the user, who is told why by ``notes``.
        """
        fixed, notes = dict(fixed or {}), dict(notes or {})

        def make(group: dist.ProcessGroup | None, options: Mapping[str, Any]) -> Any:
            return make_state(group, {**fixed, **options})

        refused = set(fixed) | set(notes)
        return cls(
            hook,
            make,
            frozenset(settings.names()) - refused,
            settings.required() - refused,
            notes,
            settings,
            fixed,
        )


def _specs() -> dict[CommHookType, HookSpec]:
    # Imported here so that ``import commhooks.config`` stays cheap and cycle-free.
    from commhooks.hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook, noop_hook
    from commhooks.hooks.local_sgd import (
        PostLocalSGDOptions,
        post_localSGD_hook,
        state_from_options,
    )

    def stateless(group: dist.ProcessGroup | None, options: Mapping[str, Any]) -> StatelessState:
        return StatelessState(group, **options)

    local = "the ranks' results differ after its warm-up, so a bucket is never sent again"
    return {
        CommHookType.NO: HookSpec(hook=None),
        CommHookType.ALLREDUCE: HookSpec.of(allreduce_hook, StatelessOptions, stateless),
        CommHookType.FP16: HookSpec.of(fp16_compress_hook, StatelessOptions, stateless),
        CommHookType.BF16: HookSpec.of(bf16_compress_hook, StatelessOptions, stateless),
        CommHookType.NOOP: HookSpec(
            noop_hook, notes={_NONFINITE: f"hook 'noop' sends nothing to repair. {_DROP}"}
        ),
        CommHookType.POST_LOCAL_SGD: HookSpec(
            post_localSGD_hook,
            state_from_options,
            frozenset({*PostLocalSGDOptions.names(), "subgroup"}),
            required=PostLocalSGDOptions.required(),
            notes={_NONFINITE: f"with hook 'post_local_sgd' {local}. {_DROP}"},
            settings=PostLocalSGDOptions,
        ),
        **_powersgd_specs(),
        **_quantized_specs(),
        **_diloco_specs(),
    }


_NONFINITE = "on_nonfinite"
_DROP = "Drop the option."


def _powersgd_specs() -> dict[CommHookType, HookSpec]:
    from commhooks.hooks.powersgd import (
        PowerSGDOptions,
        batched_powerSGD_hook,
        powerSGD_hook,
        state_maker,
    )

    # One state class serves the three hooks, but each uses only some of its options.
    layerwise, batched = state_maker(powerSGD_hook), state_maker(batched_powerSGD_hook)
    whole = "batched_power_sgd compresses each bucket whole, as one square matrix, so"
    layerwise_fix = "Use hook 'power_sgd' to compress matrix by matrix, or drop the option."
    batched_notes = {
        "min_compression_rate": f"{whole} there is no per-matrix threshold. {layerwise_fix}",
        "batch_tensors_with_same_shape": f"{whole} there is nothing to batch. {layerwise_fix}",
    }
    single_notes = {
        "single_round": "power_sgd_single_round is power_sgd with single_round=True fixed "
        "(single_round=False would make it plain power_sgd). Use hook 'power_sgd' instead, "
        "or drop the option."
    }
    return {
        CommHookType.POWER_SGD: HookSpec.of(powerSGD_hook, PowerSGDOptions, layerwise),
        CommHookType.BATCHED_POWER_SGD: HookSpec.of(
            batched_powerSGD_hook, PowerSGDOptions, batched, notes=batched_notes
        ),
        CommHookType.POWER_SGD_SINGLE_ROUND: HookSpec.of(
            powerSGD_hook,
            PowerSGDOptions,
            layerwise,
            fixed={"single_round": True},
            notes=single_notes,
        ),
    }


def _quantized_specs() -> dict[CommHookType, HookSpec]:
    from commhooks.hooks.quantized import QuantizationOptions, QuantizationState, quantized_hook

    def make(group: dist.ProcessGroup | None, options: Mapping[str, Any]) -> QuantizationState:
        return QuantizationState(group, **options)

    def spec(bits: int, other: CommHookType) -> HookSpec:
        note = f"hook 'int{bits}' sends {bits} bits per element; use hook '{other}' instead."
        return HookSpec.of(
            quantized_hook, QuantizationOptions, make, fixed={"bits": bits}, notes={"bits": note}
        )

    return {
        CommHookType.INT8: spec(8, CommHookType.INT4),
        CommHookType.INT4: spec(4, CommHookType.INT8),
    }


def _diloco_specs() -> dict[CommHookType, HookSpec]:
    from commhooks.averaging.diloco import DiLoCoOptions, diloco_hook, state_from_options

    plain = "hook 'diloco' syncs the whole model at once, without overlap; use hook "
    plain += "'streaming_diloco' for fragments, a delay or a blend, or drop the option."
    fixed = {
        "fragments": 1,
        "fragment_sync_delay": 0,
        "fragment_update_alpha": 0.0,
        "keep_inflight_steps": False,
    }
    outer = (
        "a DiLoCo sync whose average is not finite (quantized or not) leaves the outer state as "
        f"it was, so nothing is sent again. {_DROP}"
    )
    return {
        CommHookType.DILOCO: HookSpec.of(
            diloco_hook,
            DiLoCoOptions,
            state_from_options,
            fixed=fixed,
            notes={**dict.fromkeys(fixed, plain), _NONFINITE: outer},
        ),
        CommHookType.STREAMING_DILOCO: HookSpec.of(
            diloco_hook, DiLoCoOptions, state_from_options, notes={_NONFINITE: outer}
        ),
    }


# Quantized hooks average in float32 and send 8 or 4 bits: a down-cast first only loses precision.
_UNWRAPPED = (CommHookType.INT8, CommHookType.INT4)


# -- names --------------------------------------------------------------------------------------
def parse_name(
    value: Any, what: str, allowed: tuple[CommHookType, ...] | None = None
) -> CommHookType:
    """An enum member or its string (any case) as a ``CommHookType``; else ``ValueError``
    listing the valid names, with the nearest one where there is a likely typo."""
    valid = allowed or tuple(_specs())
    if isinstance(value, Enum) and not isinstance(value, CommHookType):
        value = value.value  # another library's names, e.g. Accelerate's DDPCommunicationHookType
    if value is False:  # YAML reads a bare ``no`` as false
        value = CommHookType.NO.value
    name: CommHookType | None = None
    if isinstance(value, CommHookType):
        name = value
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):
            name = CommHookType(value.strip().lower())
    else:
        raise TypeError(
            f"{what} must be a CommHookType or its name (a string), got {type(value).__name__}. "
            "To use a hook function of your own, call ddp_model.register_comm_hook(state, fn)."
        )
    if name is None or name not in valid:
        names = [v.value for v in valid]
        raise ValueError(
            f"unknown {what} {value!r}.{suggest(str(value).lower(), names)} "
            f"Valid {what}s: {', '.join(names)}."
        )
    return name


def hook_spec(hook: CommHookType | str) -> HookSpec:
    """The spec registered for ``hook``."""
    return _specs()[parse_name(hook, "hook")]


def hook_names() -> list[str]:
    """Every hook name ``register`` accepts in this installation."""
    return [kind.value for kind in _specs()]


def wrapper_names() -> list[str]:
    """Every wrapper name ``register`` accepts."""
    return [kind.value for kind in WRAPPERS]


def hooks_taking(option: str) -> list[str]:
    """The hooks whose state accepts ``option``."""
    return [kind.value for kind, spec in _specs().items() if option in spec.options]


def _check_options(kind: CommHookType, options: Mapping[str, Any]) -> None:
    spec = _specs()[kind]
    takes = ", ".join(sorted(spec.options)) or "none"
    all_options = sorted(set().union(*(s.options for s in _specs().values())))
    for option in sorted(options):
        if option in spec.options:
            continue
        elsewhere = hooks_taking(option)
        if elsewhere:
            raise ValueError(
                f"option '{option}' does not apply to hook '{kind}' (options it takes: {takes}); "
                f"it is an option of: {', '.join(elsewhere)}. "
                + spec.notes.get(option, "Choose one of those hooks or drop the option.")
            )
        note = spec.notes.get(option)
        hint = f" {note}" if note else suggest(option, sorted(spec.options) or all_options)
        raise ValueError(
            f"unknown option '{option}' for hook '{kind}'.{hint} Options it takes: {takes}."
        )


# -- configuration ------------------------------------------------------------------------------
_ALIASES = {"comm_hook": "hook", "comm_wrapper": "wrapper", "comm_state_option": "options"}


@dataclass
class HookConfig:
    """A validated hook choice that loads from and saves to a plain mapping (JSON, YAML...).

    The mapping form is flat: ``{"hook": "power_sgd", "wrapper": "fp16",
    "matrix_approximation_rank": 2}``, so ``register(ddp_model, **config.to_dict())`` works.
    ``from_dict`` also reads options nested under ``"options"`` and Accelerate's key names
    (``comm_hook``, ``comm_wrapper``, ``comm_state_option``). Everything but the backend is
    checked when the config is built; the backend when it is registered.

    Attributes:
        hook: the hook (a name is normalised to its ``CommHookType``).
        wrapper: ``no``, ``fp16`` or ``bf16``.
        options: the hook's state options, e.g. ``{"matrix_approximation_rank": 2}``.
    """

    hook: CommHookType | str
    wrapper: CommHookType | str | None = CommHookType.NO
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.hook = parse_name(self.hook, "hook")
        wrapper = CommHookType.NO if self.wrapper is None else self.wrapper
        self.wrapper = parse_name(wrapper, "wrapper", WRAPPERS)
        if not isinstance(self.options, Mapping):
            raise TypeError(
                f"HookConfig options must be a mapping of option names to values, got "
                f"{type(self.options).__name__}."
            )
        self.options = dict(self.options)
        if "process_group" in self.options:
            raise ValueError(
                "process_group is not part of a hook configuration (it cannot be saved); pass it "
                "to register(...) or register_from_config(..., process_group=...)."
            )
        _check_options(self.hook, self.options)
        spec = _specs()[self.hook]
        missing = sorted(spec.required - set(self.options))
        if missing:
            raise ValueError(
                f"hook '{self.hook}' needs the option(s) {', '.join(missing)}, which have no "
                f"default; e.g. register(ddp_model, '{self.hook}', {missing[0]}=...)."
            )
        if self.hook in _UNWRAPPED and self.wrapper is not CommHookType.NO:
            raise ValueError(
                f"hook '{self.hook}' does not take wrapper '{self.wrapper}': it already sends "
                f"{self.hook} codes and averages in float32, so a cast to {self.wrapper} first "
                "would only lose precision. Drop the wrapper (wrapper='no')."
            )
        if self.hook is CommHookType.NO and self.wrapper is not CommHookType.NO:
            raise ValueError(
                f"wrapper '{self.wrapper}' needs a hook to wrap; hook 'no' keeps DDP's own "
                f"allreduce. Use hook='allreduce', wrapper='{self.wrapper}' "
                f"(or simply hook='{self.wrapper}')."
            )
        if spec.settings is not None:  # the values, and how they go together
            names = spec.settings.names()  # the rest are groups (post_local_sgd's subgroup)
            given = {k: v for k, v in self.options.items() if k in names}
            spec.settings.from_mapping({**spec.fixed, **given})
        if "subgroup" in self.options:  # post_local_sgd's group, not an option of its settings
            from commhooks.hooks.local_sgd import check_subgroup

            check_subgroup(self.options["subgroup"], "HookConfig")
        topology = comm.Topology.of(self.options.get("topology"))
        if topology is not None:  # one value for a Topology, a mesh and their rank lists
            self.options["topology"] = topology

    @property
    def stateful(self) -> bool:
        """Whether the hook keeps a state object worth checkpointing."""
        spec = _specs()[CommHookType(self.hook)]
        return spec.make_state is not None and spec.settings is not StatelessOptions

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> "HookConfig":
        """Build from a flat or nested mapping (see the class docstring).

        Raises:
            ValueError: a missing hook, an option given twice, or any invalid name.
        """
        if not isinstance(mapping, Mapping):
            raise TypeError(
                f"HookConfig.from_dict expects a mapping, got {type(mapping).__name__}."
            )
        flat: dict[str, Any] = {}
        for key, value in mapping.items():
            key = _ALIASES.get(key, key)
            if key in flat:
                raise ValueError(f"'{key}' is given twice in the hook configuration.")
            flat[key] = value
        if "hook" not in flat:
            valid = ", ".join(hook_names())
            raise ValueError(f"the hook configuration has no 'hook' entry; valid hooks: {valid}.")
        nested = flat.pop("options", None)
        nested = {} if nested is None else nested
        if not isinstance(nested, Mapping):
            raise TypeError(f"'options' must be a mapping, got {type(nested).__name__}.")
        hook, wrapper = flat.pop("hook"), flat.pop("wrapper", None)
        twice = sorted(set(nested) & set(flat))
        if twice:
            raise ValueError(f"option(s) {', '.join(twice)} given both flat and under 'options'.")
        return cls(hook=hook, wrapper=wrapper, options={**flat, **nested})

    def to_dict(self) -> dict[str, Any]:
        """The flat mapping form: ``from_dict(config.to_dict()) == config`` (a topology as
        its rank lists, which JSON and YAML hold)."""
        options = dict(self.options)
        if isinstance(options.get("topology"), comm.Topology):
            options["topology"] = options["topology"].as_lists()
        return {"hook": str(self.hook), "wrapper": str(self.wrapper), **options}

    @classmethod
    def from_json(cls, text: str) -> "HookConfig":
        """Build from a JSON object (the mapping form).

        Raises:
            ValueError: text that is not JSON, a JSON value that is not an object, or an
                invalid configuration.
        """
        return cls.from_dict(_mapping_from_text(json.loads(text), "JSON", "<json text>"))

    def to_json(self, **dumps_kwargs: Any) -> str:
        """The mapping form as JSON; options must be JSON values (``ValueError`` naming any
        that is not, a process group say)."""
        return json.dumps(_saveable(self.to_dict(), "JSON"), **dumps_kwargs)

    @classmethod
    def from_yaml(cls, text: "str | IO[str]", *, name: str | None = None) -> "HookConfig":
        """Build from a YAML mapping: its text, or an open file. Needs PyYAML.

        Stricter than ``yaml.safe_load`` (see :mod:`commhooks._yaml`): a key given twice, or
        nesting deeper than a configuration needs, raises ``ValueError`` naming file and line.

        Args:
            text: the YAML text, or a file opened for reading (its ``name`` is used in messages).
            name: the file's name for messages, when ``text`` is its contents.

        Raises:
            ValueError: also a document that is not a mapping, or an invalid configuration.
            yaml.YAMLError: text that is not YAML.
        """
        from commhooks._yaml import load_strictly

        source = name or str(getattr(text, "name", "<yaml text>"))
        loaded = load_strictly(_yaml(), text, name)
        return cls.from_dict(_mapping_from_text(loaded, "YAML", source))

    def to_yaml(self) -> str:
        """The mapping form as YAML (options as :meth:`to_json` takes them). Needs PyYAML."""
        return str(_yaml().safe_dump(_saveable(self.to_dict(), "YAML"), sort_keys=False))


def _saveable(mapping: dict[str, Any], form: str) -> dict[str, Any]:
    """``mapping`` if every value is one a text holds (JSON's values, which YAML holds too);
    else ``ValueError`` naming the option."""
    for key, value in mapping.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"option '{key}' holds a {type(value).__name__}, which {form} cannot hold: leave "
                f"it out of the configuration saved and pass it when registering, "
                f"register(ddp_model, **config.to_dict(), {key}=...)."
            ) from None
    return mapping


def _mapping_from_text(loaded: Any, form: str, source: str) -> Mapping[str, Any]:
    """What a JSON or YAML text held, if it is the mapping form of a configuration: in a text,
    a non-mapping is a wrong value (a list of options, an empty file), so ``ValueError``."""
    if isinstance(loaded, Mapping):
        return loaded
    got = "nothing" if loaded is None else f"a {type(loaded).__name__}"
    example = _EXAMPLES[form]
    raise ValueError(
        f"{source}: a hook configuration in {form} is one mapping of names to values, e.g. "
        f"{example}; got {got}. Write each option as a name and its value, not as a list."
    )


_EXAMPLES = {
    "JSON": '{"hook": "power_sgd", "matrix_approximation_rank": 2}',
    "YAML": "'hook: power_sgd' and 'matrix_approximation_rank: 2' on lines of their own",
}


def _yaml() -> Any:
    try:
        import yaml
    except ImportError as exc:
        raise ImportError(
            "YAML configuration needs PyYAML: pip install pyyaml (or use the JSON or dict form)."
        ) from exc
    return yaml


# -- registration -------------------------------------------------------------------------------
def register(
    ddp_model: Any,
    hook: CommHookType | str,
    wrapper: CommHookType | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> Any:
    """Build the state for ``hook`` from ``options``, wrap, register on ``ddp_model``.

    Everything is checked first, so a mistake raises here, with the fix, rather than from
    inside the first backward pass.

    Args:
        ddp_model: a ``DistributedDataParallel`` model without a hook yet.
        hook: a ``CommHookType`` or its name (``"power_sgd"``...). ``"no"`` registers nothing.
        wrapper: ``None``/``"no"``, ``"fp16"`` or ``"bf16"``: run the hook on a down-cast bucket.
        process_group: the group to communicate on; ``None`` for the DDP model's own group.
        **options: the hook's state options, e.g. ``matrix_approximation_rank=2``.

    Returns:
        the state object registered with the hook (keep it to checkpoint it); for hooks that
        keep no state (and ``"no"``, which registers nothing), a ``StatelessState`` holding the
        process group, whose state dict is an empty, versioned entry.

    Raises:
        ValueError: an unknown or unfit hook, wrapper or option; bf16 on a backend without it;
            a model that already has a hook; a process group this rank is not in.
        TypeError: ``ddp_model`` is not a ``DistributedDataParallel`` model.
    """
    return register_from_config(
        ddp_model, HookConfig(hook, wrapper, options), process_group=process_group
    )


def register_from_config(
    ddp_model: Any,
    config: "HookConfig | Mapping[str, Any]",
    process_group: dist.ProcessGroup | None = None,
) -> Any:
    """``register`` with the choice given as a ``HookConfig`` or its mapping form.

    Example::

        config = HookConfig.from_yaml(open("hook.yaml"))
        state = register_from_config(ddp_model, config)
    """
    if not isinstance(config, HookConfig):
        config = HookConfig.from_dict(config)
    kind, wrap = CommHookType(config.hook), CommHookType(config.wrapper)
    if kind is CommHookType.NO:
        return StatelessState(process_group)
    group = _check_target(ddp_model, kind, wrap, process_group)
    spec = _specs()[kind]
    # Stateless hooks get a state too, so that whatever register returned can be checkpointed.
    state = (
        spec.make_state(group, dict(config.options)) if spec.make_state else StatelessState(group)
    )
    fn = spec.hook
    assert fn is not None, "only hook 'no' has none, returned above"
    if wrap is not CommHookType.NO:
        from commhooks.hooks import bf16_compress_wrapper, fp16_compress_wrapper

        fn = (fp16_compress_wrapper if wrap is CommHookType.FP16 else bf16_compress_wrapper)(fn)
    try:
        ddp_model.register_comm_hook(state, fn)
    except RuntimeError as exc:  # DDP's own refusal: a hook registered without us
        if "only be called once" not in str(exc):
            raise
        raise ValueError(_TWICE) from exc
    _hooked.add(ddp_model)
    return state


_TWICE = (
    "this DDP model already has a communication hook, and DDP accepts only one per model. "
    "Register a single hook (combine a hook with a cast through wrapper='fp16' or 'bf16'), or "
    "build a new DistributedDataParallel model."
)
_hooked: "weakref.WeakSet[Any]" = weakref.WeakSet()  # DDP models given a hook by register()


def _check_target(
    ddp_model: Any, kind: CommHookType, wrap: CommHookType, process_group: Any
) -> dist.ProcessGroup | None:
    """Check the model, the group and the backend; return the group to give the state."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"commhooks.register expects the DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}. Wrap the model first: DistributedDataParallel(model)."
        )
    if ddp_model in _hooked:
        raise ValueError(_TWICE)
    chosen: dist.ProcessGroup | None = process_group
    if chosen is None and not comm.is_default_group(ddp_model.process_group):
        # The hook must average over the ranks DDP synchronises, not the whole world.
        chosen = ddp_model.process_group
    group = comm.resolve_group(chosen, owner="commhooks.register")
    _check_same_ranks(group, ddp_model.process_group)
    if CommHookType.BF16 in (kind, wrap):
        _check_bf16(group, getattr(ddp_model, "device_type", "cpu"))
    return chosen


def _check_same_ranks(group: dist.ProcessGroup, ddp_group: dist.ProcessGroup | None) -> None:
    """Refuse a hook group whose ranks are not the DDP model's: DDP ranks outside it would
    wait for gradients that never come, and time out without naming the cause."""
    mine, ddp = comm.global_ranks(group), comm.global_ranks(ddp_group)
    if sorted(mine) != sorted(ddp):
        raise ValueError(
            f"commhooks.register: the hook's process group holds global ranks {mine}, but the "
            f"DDP model synchronises ranks {ddp}. A hook must average over the DDP model's "
            "ranks: pass process_group=None (the DDP model's own group) or a group of those "
            "ranks."
        )


def _check_bf16(group: dist.ProcessGroup, device_type: str) -> None:
    backend = comm.backend_for_device(group, device_type)
    if backend == "gloo":
        return
    if backend == "nccl":
        version = _nccl_version()
        if version is None or version >= (2, 10):
            return
        found = ".".join(map(str, version))
        raise ValueError(
            f"bf16 communication needs NCCL 2.10 or newer; this PyTorch has NCCL {found}. "
            "Use hook/wrapper 'fp16' instead, or a PyTorch build with a newer NCCL."
        )
    raise ValueError(
        f"the '{backend}' backend of this process group does not allreduce bfloat16. Use "
        "hook/wrapper 'fp16' instead, or a gloo or NCCL (2.10+) process group."
    )


def _nccl_version() -> tuple[int, ...] | None:
    import torch

    try:
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]  # torch's own
    except Exception:  # no CUDA build: nothing to check against
        return None
    return tuple(version) if isinstance(version, tuple) else None
