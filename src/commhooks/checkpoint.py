"""Save and restore a trainer's model, optimizer and hook states together, all or nothing.

``torch.load`` of a truncated or foreign file fails without saying which file or what to do,
and a trainer whose hook state turns out wrong after its model loaded is left half restored.
:func:`load` checks the whole file first, and if any object refuses its entry, puts back the
ones it changed::

    commhooks.checkpoint.save("ckpt.pt", model=ddp.module, optimizer=opt, hook=state)
    ...
    commhooks.checkpoint.load("ckpt.pt", model=ddp.module, optimizer=opt, hook=state)

Files are written with ``torch.save`` and read with ``weights_only=True``: only tensors and plain
containers, never arbitrary pickled objects.
"""

import copy
import os
import pickle
import socket
import tempfile
import time
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from commhooks._warnings import CommHooksWarning

__all__ = ["CheckpointError", "load", "read", "remove_leftovers", "save"]

FORMAT = "commhooks.checkpoint"
VERSION = 1
PathLike = str | os.PathLike[str]

# Temporary files are named ``.commhooks-<target>.<host>.<pid>.<random>.tmp``, so that a save
# can tell the leftovers of a crashed save to the same target from a save still under way.
_TMP_PREFIX, _TMP_SUFFIX = ".commhooks-", ".tmp"
# A leftover of an unknown or remote writer is only removed once it has not changed for this
# long: no save pauses that long between two writes.
_STALE_SECONDS = 600.0


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: Mapping[str, Any], /) -> Any: ...


class CheckpointError(ValueError):
    """The checkpoint cannot be used; no object was changed."""


def save(path: PathLike, **objects: Stateful) -> None:
    """Write every object's ``state_dict()`` to ``path``, atomically and durably: a crash at
    any moment leaves the previous file or the new one, whole (see :func:`write_atomically`)."""
    if not objects:
        raise ValueError("checkpoint.save needs at least one object, e.g. save(path, hook=state).")
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "entries": {name: obj.state_dict() for name, obj in objects.items()},
    }
    write_atomically(payload, path)


def write_atomically(obj: Any, path: PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, ``fsync``-ed with its directory,
    then renamed into place and the directory ``fsync``-ed again, so the content is on disk
    before its name is. Leftovers of killed saves to ``path`` are removed first."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    remove_leftovers(path)
    host = socket.gethostname().replace(".", "_")
    prefix = f"{_TMP_PREFIX}{os.path.basename(path)}.{host}.{os.getpid()}."
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=_TMP_SUFFIX, dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_directory(folder)
        os.replace(tmp, path)
        _fsync_directory(folder)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def remove_leftovers(path: PathLike) -> list[str]:
    """Remove (and return) the temporary files killed saves to ``path`` left beside it: those
    of a process of this machine that no longer runs, or of an unknown writer, unchanged for
    ten minutes. Saves under way are never touched."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    removed = []
    for name in _temporary_files(folder, os.path.basename(path)):
        full = os.path.join(folder, name)
        if _abandoned(name, full):
            try:
                os.unlink(full)
            except FileNotFoundError:  # another save cleaned it up first
                continue
            removed.append(full)
    return removed


def _temporary_files(folder: str, target: str) -> list[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [
        n
        for n in names
        if n.startswith(_TMP_PREFIX)
        and n.endswith(_TMP_SUFFIX)
        and (n.startswith(f"{_TMP_PREFIX}{target}.") or "." not in n[len(_TMP_PREFIX) : -4])
    ]


def _abandoned(name: str, full: str) -> bool:
    parts = name[: -len(_TMP_SUFFIX)].split(".")
    host = socket.gethostname().replace(".", "_")
    if len(parts) >= 4 and parts[-3] == host and parts[-2].isdigit():
        return not _running(int(parts[-2]))
    try:
        return time.time() - os.path.getmtime(full) > _STALE_SECONDS
    except OSError:
        return False


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process is not writing it: it is writing a new one
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _fsync_directory(folder: str) -> None:
    # Makes a rename or a new name durable; some file systems cannot open a directory.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read(path: PathLike) -> dict[str, Any]:
    """Read ``path`` safely and return its entries, or raise :class:`CheckpointError`
    (``FileNotFoundError`` where there is no file)."""
    payload = read_weights_only(path, what="checkpoint")
    shown = os.fspath(path)
    if not isinstance(payload, Mapping) or payload.get("format") != FORMAT:
        raise CheckpointError(
            f"{shown} is not a commhooks checkpoint (no '{FORMAT}' header). Write it "
            "with commhooks.checkpoint.save, or load a single state dict with "
            "state.load_state_dict(torch.load(path, weights_only=True))."
        )
    version = payload.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= VERSION:
        raise CheckpointError(
            f"{shown} has checkpoint format version {version!r}; this release reads 1 to "
            f"{VERSION}. Upgrade commhooks if the file is newer; otherwise it is damaged."
        )
    entries = payload.get("entries")
    if not isinstance(entries, Mapping) or not all(isinstance(k, str) for k in entries):
        raise CheckpointError(
            f"{shown} is damaged: its 'entries' must map names to state dicts, got "
            f"{type(entries).__name__}. It was not loaded; use an earlier checkpoint."
        )
    return dict(entries)


def load(path: PathLike, **objects: Stateful) -> list[str]:
    """Restore each object from the entry of the same name in ``path``, all or nothing.

    Returns:
        the names of the file's entries no object was given for, sorted, also named in a
        warning (a resumed trainer that forgot one would otherwise restart it silently).

    Raises:
        CheckpointError: the file is unreadable, foreign, lacks an entry, or an object rejects
            its entry. Every object is then as it was before the call.
        FileNotFoundError: there is no file at ``path``.
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
    left = sorted(set(entries) - set(objects))
    if left:
        warnings.warn(
            f"checkpoint.load: {os.fspath(path)} also holds {', '.join(left)}, which were not "
            f"loaded. Pass them too (load(path, {left[0]}=...)) to restore them.",
            CommHooksWarning,
            stacklevel=2,
        )
    return left


# What torch's weights-only unpickler says when it refuses a type or function the file
# really holds (a pickled object: possibly code). Anything else means the bytes are not a
# torch file (random bytes, pickle.dump) or are damaged.
_REFUSALS = (
    "GLOBAL",
    "global",
    "is blocked",
    "Can only create new object",
    "Can only build",
    "unrecognized function",
)


def read_weights_only(path: PathLike, *, what: str) -> Any:
    """``torch.load(path, weights_only=True)`` with errors that say what is wrong with the file
    (never to load it with ``weights_only=False``, which could run its code)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no {what} file at {path}.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = next((r for r in _reasons(str(exc)) if any(m in r for m in _REFUSALS)), None)
        if refused is not None:
            raise CheckpointError(
                f"{path} holds pickled Python objects, which a weights-only load refuses "
                f"because loading them could run code ({refused}). It was not loaded. Save "
                f"{what}s from state_dict(), which holds only tensors and plain values, and "
                "load only files you trust."
            ) from exc
        raise _unreadable(path, what, _first_reason(str(exc))) from exc
    except Exception as exc:  # torch.load reports damage as many different exception types
        raise _unreadable(path, what, f"{type(exc).__name__}: {_first_reason(str(exc))}") from exc


def _reasons(text: str) -> list[str]:
    """The unpickler's own lines in a ``torch.load`` error, without torch's advice to retry
    with ``weights_only=False``, the opposite of ours."""
    text = text.replace("WeightsUnpickler error:", "\n")
    lines = [line.strip() for line in text.splitlines()]
    return [
        line.split(" Please use ")[0].rstrip(". ")
        for line in lines
        if line
        and "weights_only" not in line
        and not line.startswith(("Weights only load failed", "Check the documentation"))
    ]


def _first_reason(text: str) -> str:
    reasons = _reasons(text)
    return reasons[0] if reasons else "unreadable"


def _unreadable(path: str, what: str, reason: str) -> CheckpointError:
    return CheckpointError(
        f"{path} is truncated, corrupt or not a file written by torch.save or "
        f"commhooks.checkpoint.save (a pickle.dump file, say) ({reason}); it was not loaded. "
        f"Use the last complete {what}, or save again."
    )
