"""Save and restore a trainer's model, optimizer and hook states together, all or nothing.

``torch.load`` of a truncated or foreign file fails with an unpickling error that does not say
which file or what to do, and a trainer that loads its model, then its optimizer, then a hook
state that turns out to be wrong is left half restored. :func:`load` reads and checks the whole
file first, then loads each object, and if any object refuses its entry, puts back the ones it
already changed::

    commhooks.checkpoint.save("ckpt.pt", model=ddp.module, optimizer=opt, hook=state)
    ...
    commhooks.checkpoint.load("ckpt.pt", model=ddp.module, optimizer=opt, hook=state)

Files are written with ``torch.save`` and read with ``weights_only=True``: only tensors and plain
containers, never arbitrary pickled objects.
"""

import copy
import os
import pickle
import tempfile
from collections.abc import Mapping
from typing import Any, Protocol

import torch

__all__ = ["CheckpointError", "load", "read", "save"]

FORMAT = "commhooks.checkpoint"
VERSION = 1


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: Mapping[str, Any], /) -> Any: ...


class CheckpointError(ValueError):
    """The checkpoint cannot be used; no object was changed."""


def save(path: str | os.PathLike, **objects: Stateful) -> None:
    """Write every object's ``state_dict()`` to ``path``, atomically.

    The file is written next to ``path`` and renamed into place, so an interrupted save never
    leaves a truncated checkpoint under the final name.
    """
    if not objects:
        raise ValueError("checkpoint.save needs at least one object, e.g. save(path, hook=state).")
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "entries": {name: obj.state_dict() for name, obj in objects.items()},
    }
    write_atomically(payload, path)


def write_atomically(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename it into place."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".commhooks-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read(path: str | os.PathLike) -> dict[str, Any]:
    """Read ``path`` safely and return its entries, or raise :class:`CheckpointError`."""
    payload = read_weights_only(path, what="checkpoint")
    if not isinstance(payload, Mapping) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{os.fspath(path)} is not a commhooks checkpoint (no '{FORMAT}' header). Write it "
            "with commhooks.checkpoint.save, or load a single state dict with "
            "state.load_state_dict(torch.load(path, weights_only=True))."
        )
    if not isinstance(payload.get("version"), int) or payload["version"] > VERSION:
        raise CheckpointError(
            f"{os.fspath(path)} has checkpoint format version {payload.get('version')!r}; this "
            f"release reads up to {VERSION}. Upgrade commhooks."
        )
    return dict(payload["entries"])


def load(path: str | os.PathLike, **objects: Stateful) -> None:
    """Restore each object from the entry of the same name in ``path``, all or nothing.

    Raises:
        CheckpointError: the file is unreadable, foreign, lacks an entry, or an object rejects
            its entry. Every object is then as it was before the call.
    """
    entries = read(path)
    missing = sorted(set(objects) - set(entries))
    if missing:
        raise CheckpointError(
            f"{os.fspath(path)} has no entry for {', '.join(missing)}; it holds "
            f"{', '.join(sorted(entries)) or 'nothing'}. Nothing was loaded."
        )
    backups: list[tuple[Stateful, dict[str, Any]]] = []
    for name, obj in objects.items():
        backups.append((obj, copy.deepcopy(obj.state_dict())))
        try:
            obj.load_state_dict(entries[name])
        except Exception as exc:
            for restored, previous in reversed(backups):
                restored.load_state_dict(previous)
            raise CheckpointError(
                f"{os.fspath(path)}: entry '{name}' does not fit {type(obj).__name__}: {exc} "
                "Nothing was loaded."
            ) from exc


# What torch's weights-only unpickler says when it refuses a type that the file really holds.
# Every other unpickling error means the bytes are not a torch file (random bytes, pickle.dump).
_REFUSALS = (
    "Unsupported global",
    "is blocked",
    "Can only create new object",
    "Can only build",
    "unrecognized function",
)


def read_weights_only(path: str | os.PathLike, *, what: str) -> Any:
    """``torch.load(path, weights_only=True)`` with errors that say what is wrong with the file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {what} file at {path}.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = _unpickler_reason(exc)
        if any(refusal in reason for refusal in _REFUSALS):
            raise CheckpointError(
                f"{path} holds objects that a weights-only load refuses ({reason}). Save "
                f"{what}s from state_dict(), which holds only tensors and plain values."
            ) from exc
        raise _unreadable(path, what, reason) from exc
    except Exception as exc:  # torch.load reports damage as many different exception types
        raise _unreadable(path, what, f"{type(exc).__name__}: {exc}") from exc


def _unpickler_reason(exc: Exception) -> str:
    """The unpickler's own words from a ``torch.load`` error, without torch's advice.

    Torch wraps every weights-only failure in advice to retry with ``weights_only=False``,
    the opposite of ours, and adds it even when the file is just not a torch file.
    """
    text = str(exc)
    _, marker, rest = text.partition("WeightsUnpickler error:")
    if not marker:
        rest = text.removeprefix("Weights only load failed.")
    lines = [line.strip() for line in rest.splitlines() if line.strip()]
    reason = lines[0] if lines else type(exc).__name__
    return reason.split(" Please use ")[0].rstrip(". ")


def _unreadable(path: str, what: str, reason: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is truncated, corrupt or not a file written by torch.save or "
        f"commhooks.checkpoint.save (a pickle.dump file, say) ({reason}); it was not loaded. "
        f"Use the last complete {what}, or save again."
    )
