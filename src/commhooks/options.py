"""Typed, frozen options objects: every option of a hook or averager spelled once, with its reason.

Each stateful object takes its options through one frozen dataclass derived from
:class:`Options`. A field carries its default, a one-line reason (why a user would change it)
and a checker, run when the object is built, so a bad value is reported where it was written,
never from inside a backward pass. Everything else (``register``, ``HookConfig``, the
integrations, state dicts) reads names, defaults, reasons and checks from the class.

Example::

    @dataclass(frozen=True, kw_only=True)
    class MyOptions(Options):
        owner: ClassVar[str] = "MyState"
        rank: int = option(1, "lower rank => more compression", check=integer(minimum=1))
"""

import dataclasses
import difflib
import math
import numbers
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast, overload

__all__ = [
    "Checker",
    "Options",
    "SettingView",
    "count",
    "flag",
    "integer",
    "nonfinite_option",
    "one_of",
    "option",
    "real",
    "suggest",
]

Checker = Callable[[str, str, Any], Any]
"""``check(owner, name, value) -> value``: the value normalised, or ``ValueError`` with the fix."""

OptionsT = TypeVar("OptionsT", bound="Options")
V = TypeVar("V")

_REASON, _CHECK = "reason", "check"


def option(
    default: Any = dataclasses.MISSING, reason: str = "", check: Checker | None = None
) -> Any:
    """Declare one option: its default (none: the option is required), why to set it, its check."""
    return dataclasses.field(default=default, metadata={_REASON: reason, _CHECK: check})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """Base of every options object: checks each field when built, describes the fields.

    Subclasses are ``@dataclass(frozen=True, kw_only=True)``, set :attr:`owner` (the name in
    messages), declare fields with :func:`option`, and may override :meth:`check_together`.
    """

    owner: ClassVar[str] = "options"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            given = getattr(self, f.name)
            check = f.metadata.get(_CHECK)
            if check is not None:
                object.__setattr__(self, f.name, check(self.owner, f.name, given))
            # The value as given, not as checked: a checker may have turned 8.0 into 8.
            kind = _integer_kind(f.type)
            if kind == "int" or (kind == "optional" and given is not None):
                _refuse_non_integer(self.owner, f.name, given)
        self.check_together()

    def check_together(self) -> None:
        """Raise ``ValueError`` for combinations of valid values that do not work together."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option name, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def required(cls) -> frozenset[str]:
        """Options without a default."""
        return frozenset(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The default of every option that has one."""
        return {
            f.name: f.default
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING
        }

    @classmethod
    def reason(cls, name: str) -> str:
        """The one-line reason given for ``name``."""
        for f in dataclasses.fields(cls):
            if f.name == name:
                return str(f.metadata.get(_REASON, ""))
        raise KeyError(name)

    @classmethod
    def from_mapping(cls: type[OptionsT], values: Mapping[str, Any]) -> OptionsT:
        """Build from a mapping of option names, refusing unknown names with the nearest one.

        Raises:
            ValueError: an unknown or missing option, or a value its check refuses.
        """
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            name = unknown[0]
            raise ValueError(
                f"{cls.owner}: unknown option '{name}'.{suggest(name, cls.names())} "
                f"Options it takes: {', '.join(cls.names())}."
            )
        missing = sorted(cls.required() - set(values))
        if missing:
            raise ValueError(
                f"{cls.owner}: option '{missing[0]}' has no default and must be given "
                f"({cls.reason(missing[0])})."
            )
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        """Every option and its value: plain values, fit for JSON and state dicts."""
        return {name: getattr(self, name) for name in self.names()}

    def replace(self: OptionsT, **changes: Any) -> OptionsT:
        """A copy with ``changes`` applied, checked again."""
        return dataclasses.replace(self, **changes)


class _Configured(Protocol):
    @property
    def settings(self) -> Options: ...


class SettingView(Generic[V]):
    """A read-only attribute of a state showing one field of its ``settings``: the attributes
    of the states they port (``state.matrix_approximation_rank``), spelled once. Assigning
    raises ``AttributeError`` naming the fix: ranks that changed an option apart would issue
    different collectives."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> "SettingView[V]": ...

    @overload
    def __get__(self, obj: _Configured, objtype: type | None = None) -> V: ...

    def __get__(self, obj: _Configured | None, objtype: type | None = None) -> "V | SettingView[V]":
        if obj is None:
            return self
        return cast(V, getattr(obj.settings, self.name))

    def __set__(self, obj: _Configured, value: V) -> None:
        owner = type(obj).__name__
        raise AttributeError(
            f"{owner}.{self.name} is fixed when the state is built (it is read from "
            f"{owner}.settings); build a new {owner}(..., {self.name}={value!r}) to change it."
        )


def suggest(name: str, candidates: "tuple[str, ...] | list[str]") -> str:
    """``" Did you mean 'x'?"`` for the closest candidate, or an empty string."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def _refuse(owner: str, name: str, value: Any, rule: str, hint: str) -> ValueError:
    tail = f" ({hint})" if hint else ""
    return ValueError(f"{owner}: {name} must be {rule}{tail}; got {name}={value!r}.")


def _refuse_non_integer(owner: str, name: str, value: Any) -> None:
    """An option declared ``int`` (or ``int | None``, when given) is given as an ``int``,
    whatever its checker: ``one_of(8, 4)`` would take ``8.0``, which would pass the ranks'
    handshake and fail inside a backward pass, and a configuration would still hold it."""
    if not _is_integer(value):
        whole = isinstance(value, float) and value.is_integer()
        shown = f" ({int(value)} without the point)" if whole else ""
        raise ValueError(
            f"{owner}: {name} must be an integer{shown}, not {type(value).__name__}; "
            f"got {name}={value!r}."
        )


def _integer_kind(declared: Any) -> str | None:
    """``"int"`` for a field declared ``int``, ``"optional"`` for ``int | None`` (or
    ``Optional[int]``), ``None`` for any other type (a union with a tuple, a float...)."""
    if declared in (int, "int"):
        return "int"
    if isinstance(declared, str):
        spelled = declared.replace(" ", "")
        return "optional" if spelled in ("int|None", "None|int", "Optional[int]") else None
    if typing.get_origin(declared) in (typing.Union, types.UnionType):
        return "optional" if set(typing.get_args(declared)) == {int, type(None)} else None
    return None


def _is_numpy_bool(value: Any) -> bool:
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")


def _is_integer(value: Any) -> bool:
    # numpy integers count; a bool is a flag given by mistake.
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and not _is_numpy_bool(value)
    )


def integer(minimum: int | None = None, maximum: int | None = None, hint: str = "") -> Checker:
    """An integer in ``[minimum, maximum]`` (either bound optional), returned as ``int``."""
    rule = "an integer" + _bounds(minimum, maximum)

    def check(owner: str, name: str, value: Any) -> int:
        if not _is_integer(value):
            raise _refuse(owner, name, value, rule, hint)
        number = int(value)
        if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
            raise _refuse(owner, name, value, rule, hint)
        return number

    return check


def count(minimum: int, hint: str = "") -> Checker:
    """A whole number of steps or items, at least ``minimum``, returned as ``int``, in the
    averagers' wording ("must be an integer", "must be >= minimum")."""
    tail = f" {hint}" if hint else ""

    def check(owner: str, name: str, value: Any) -> int:
        if not _is_integer(value):
            raise ValueError(f"{owner}: {name} must be an integer, got {value!r}.{tail}")
        if int(value) < minimum:
            raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}.{tail}")
        return int(value)

    return check


def real(
    minimum: float | None = None,
    maximum: float | None = None,
    hint: str = "",
    keep_int: bool = False,
    finite: bool = True,
) -> Checker:
    """A finite real number in ``[minimum, maximum]``, returned as ``float``; ``keep_int`` keeps
    integers and ``finite=False`` takes an infinity, where PyTorch's own state does."""
    rule = ("a finite number" if finite else "a number") + _bounds(minimum, maximum)

    def check(owner: str, name: str, value: Any) -> float | int:
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or _is_numpy_bool(value):
            raise _refuse(owner, name, value, rule, hint)
        number = float(value)
        if (
            math.isnan(number)
            or (finite and math.isinf(number))
            or (minimum is not None and number < minimum)
            or (maximum is not None and number > maximum)
        ):
            raise _refuse(owner, name, value, rule, hint)
        return int(number) if keep_int and _is_integer(value) else number

    return check


def flag(hint: str = "", strict: bool = True) -> Checker:
    """``True`` or ``False`` (``"False"``, a string, is refused); ``strict=False`` also takes
    numpy booleans and 0 and 1, as PyTorch's states do."""

    def check(owner: str, name: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        lenient = _is_numpy_bool(value) or (_is_integer(value) and value in (0, 1))
        if not strict and lenient:
            return bool(value)
        raise _refuse(owner, name, value, "True or False", hint)

    return check


def one_of(*choices: Any, hint: str = "") -> Checker:
    """One of ``choices`` (compared with ``==``; strings case-sensitively)."""
    rule = "one of " + ", ".join(repr(c) for c in choices)

    def check(owner: str, name: str, value: Any) -> Any:
        if isinstance(value, bool) or value not in choices:
            raise _refuse(owner, name, value, rule, hint)
        return value

    return check


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{_shown(minimum)}, {_shown(maximum)}]"
    if minimum is not None:
        return f" >= {_shown(minimum)}"
    if maximum is not None:
        return f" <= {_shown(maximum)}"
    return ""


def _shown(bound: float) -> str:
    # Integers in full (a seed's bound is 4294967295, not 4.29497e+09).
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def nonfinite_option() -> Any:
    """The ``on_nonfinite`` option every compressing hook takes (:mod:`commhooks.hooks.repair`)."""
    return option(
        "propagate",
        "'propagate' returns a non-finite average as plain allreduce would (a loss scaler then "
        "skips the step); 'repair' averages such a bucket again in full precision, where the "
        "compression overflowed (one wait for the device a step)",
        one_of("propagate", "repair"),
    )
