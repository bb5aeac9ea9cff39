"""``--model package.module:factory``: benchmark the model you will train, not a stand-in.

The factory is any callable that takes no arguments and returns either

* a :class:`BenchModel`: the model, a batch maker ``make_batch(rank, step)`` and, optionally,
  a loss ``loss(model, batch)`` and held-out batches; or
* a pair ``(model, batch)``: the same batch every step.

Without a loss, the model's output on the batch is the loss: a tensor with one element, or an
object with a ``loss`` attribute (as Hugging Face models return when given labels). A batch is
a tensor (``model(batch)``), a tuple or list (``model(*batch)``) or a dict (``model(**batch)``);
the bench moves its tensors to the rank's device and leaves their dtype alone, so the model
trains at your batch size, in your dtype. Held-out loss: on ``heldout`` when given, otherwise on
the batch of the step after the last one timed, before any rank has trained on it.

Example (``mypkg/bench_model.py``, run as ``commhooks bench --model mypkg.bench_model:make``)::

    def make() -> BenchModel:
        model = MyNet()
        def make_batch(rank: int, step: int):
            g = torch.Generator().manual_seed(1000 * rank + step)
            return torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)
        return BenchModel(model, make_batch, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
"""

import contextlib
import importlib
import os
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from commhooks.bench.tasks import Task, to_device
from commhooks.testing import describe

__all__ = [
    "BenchModel",
    "BenchModelError",
    "call_model",
    "check_factory",
    "load_factory",
    "split_name",
    "task_from_factory",
]

FORM = "package.module:factory"


class BenchModelError(ValueError):
    """``--model`` names something the bench cannot train; the message says what to change."""


@dataclass(frozen=True)
class BenchModel:
    """What a ``--model`` factory returns: the model and how to feed it.

    Attributes:
        model: the module to wrap in DDP (on the CPU, or anywhere: the bench moves it to the
            rank's device).
        make_batch: ``(rank, step) -> batch``; a different batch per rank, the same for every
            hook, so that their losses compare.
        loss: ``(model, batch) -> scalar tensor``; ``None``: the model's output is the loss.
        heldout: batches for the held-out loss (empty: the batch after the last timed step).
    """

    model: nn.Module
    make_batch: Callable[[int, int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None
    heldout: Sequence[Any] = ()


def split_name(text: str) -> tuple[str, str]:
    """``package.module:factory`` as its module and its name.

    Raises:
        BenchModelError: ``text`` is not of that form.
    """
    module, sep, name = text.partition(":")
    if not sep or not module or not name.isidentifier():
        raise BenchModelError(
            f"--model {text!r}: give {FORM}, e.g. --model mypkg.models:make_bench_model."
        )
    return module, name


def load_factory(text: str) -> Callable[[], Any]:
    """Import the factory ``package.module:factory``.

    Raises:
        BenchModelError: a malformed name, a module that is not found or raises while it is
            imported (a syntax error too), or a name that is missing or not callable.
    """
    module_name, name = split_name(text)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BenchModelError(
            f"--model {text!r}: cannot import {module_name!r} ({exc}); run from the directory "
            "that holds it or add that directory to PYTHONPATH (on every node)."
        ) from None
    except Exception as exc:  # the user's code, whatever it raises: one line, not a traceback
        raise BenchModelError(
            f"--model {text!r}: importing {module_name!r} raised {_at(exc)}; fix the module "
            f"until `python -c 'import {module_name}'` runs."
        ) from None
    factory = getattr(module, name, None)
    if factory is None:
        raise BenchModelError(f"--model {text!r}: module {module_name!r} has no {name!r}.")
    if not callable(factory):
        raise BenchModelError(
            f"--model {text!r}: {name!r} is a {type(factory).__name__}, not a callable that "
            "returns the model (a function, or a class)."
        )
    return factory  # type: ignore[no-any-return]


def _bench_model(text: str, made: Any) -> BenchModel:
    """``made`` as a :class:`BenchModel`, or an error saying what the factory should return."""
    if isinstance(made, BenchModel):
        bench = made
    elif isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        fixed = made[1]
        bench = BenchModel(made[0], lambda rank, step: fixed)
    else:
        raise BenchModelError(
            f"--model {text!r} returned a {type(made).__name__}; return "
            "commhooks.bench.usermodel.BenchModel(model, make_batch, loss) or a "
            "(model, batch) pair."
        )
    if not isinstance(bench.model, nn.Module) or not any(
        p.requires_grad for p in bench.model.parameters()
    ):
        raise BenchModelError(
            f"--model {text!r}: the model must be a torch.nn.Module with trainable parameters."
        )
    if not callable(bench.make_batch) or (bench.loss is not None and not callable(bench.loss)):
        raise BenchModelError(
            f"--model {text!r}: make_batch must be a callable (rank, step) -> batch and loss a "
            "callable (model, batch) -> scalar tensor."
        )
    return bench


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model`` applied to ``batch``: a dict as keywords, a tuple or list as arguments."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _output_loss(text: str) -> Callable[[nn.Module, Any], torch.Tensor]:
    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        out = call_model(model, batch)
        value = getattr(out, "loss", out)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.reshape(())
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise BenchModelError(
            f"--model {text!r}: the model's output on its batch is {shape}, not a loss; return "
            "BenchModel(model, make_batch, loss=lambda model, batch: ...) with a loss that "
            "gives one number."
        )

    return loss


def check_factory(text: str, seed: int, device: torch.device, rank: int = 0) -> None:
    """Build ``--model text`` once and run one forward and backward pass on ``device``.

    The bench runs every hook in fresh ranks; a model that cannot train there would fail every
    row alike, after minutes, and end in a report with nothing in it. Checked once before any
    hook runs, it fails in one line that says what to change instead. The model, its batch
    (``make_batch(rank, 0)``) and the loss are those the runs will use; nothing is kept.

    Raises:
        BenchModelError: the step that failed, how, and what to change.
    """
    factory = load_factory(text)
    torch.manual_seed(seed)
    with _running(text, "calling the factory", _FIXES["factory"]):
        made = factory()
    bench = _bench_model(text, made)
    with _running(text, f"make_batch({rank}, 0)", _FIXES["make_batch"]):
        batch = bench.make_batch(rank, 0)
    loss_of = bench.loss or _output_loss(text)
    with _running(text, f"the loss on {device}", _FIXES["loss"]):
        loss = loss_of(bench.model.to(device), to_device(batch, device))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shown = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise BenchModelError(
            f"--model {text!r}: the loss is {shown}, not one number; give BenchModel a loss "
            "that returns a tensor of one element."
        )
    with _running(text, "the backward pass", _FIXES["backward"]):
        torch.autograd.backward(loss)


# What to change when each step of the check raises.
_FIXES = {
    "factory": "it must build the model when called with no arguments",
    "make_batch": "it must return a batch for any rank and step",
    "loss": "the model must take its batch as the bench passes it (a tensor: model(batch); "
    "a tuple or list: model(*batch); a dict: model(**batch)), or give BenchModel a loss",
    "backward": "the loss must be computed from the model's trainable parameters",
}


@contextlib.contextmanager
def _running(text: str, what: str, fix: str) -> Iterator[None]:
    """Turn whatever the user's code raises inside into one :class:`BenchModelError` line."""
    try:
        yield
    except BenchModelError:
        raise
    except Exception as exc:
        raise BenchModelError(
            f"--model {text!r}: {what} raised {_at(exc)}; {_fix(exc, fix)}."
        ) from None


def _fix(exc: BaseException, fix: str) -> str:
    """What to change: the step's own advice, unless the cause is a missing GPU."""
    if "cuda" in str(exc).lower() and not torch.cuda.is_available():
        return (
            "this machine has no CUDA: build the model and its batches on the CPU (the bench "
            "moves them to each rank's device)"
        )
    return fix


def _at(exc: BaseException) -> str:
    """The exception in one line, and the line of the user's code that raised it."""
    said = describe(exc)
    if isinstance(exc, SyntaxError):  # its message names the file and line already
        return said
    ours = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(ours) and not f.filename.startswith("<frozen")
    ]
    if not frames:
        return said
    return f"{said} ({os.path.basename(frames[-1].filename)}, line {frames[-1].lineno})"


def task_from_factory(text: str, seed: int, heldout_step: int) -> Task:
    """The task of ``--model text``: the factory's model, batches and loss.

    ``torch.manual_seed(seed)`` comes first, so that every rank and hook starts from the same
    weights when the factory draws them from the global generator.
    """
    torch.manual_seed(seed)
    bench = _bench_model(text, load_factory(text)())
    loss = bench.loss or _output_loss(text)
    heldout = list(bench.heldout) or [bench.make_batch(0, heldout_step)]
    params = sum(p.numel() for p in bench.model.parameters())
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in bench.model.parameters()})
    describe = {"kind": f"--model {text}", "parameters": params, "dtypes": dtypes}
    return Task(
        text,
        bench.model,
        describe,
        bench.make_batch,
        heldout,
        loss_fn=lambda batch, model: loss(model, batch),
    )
