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

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from commhooks.bench.tasks import Task

__all__ = ["BenchModel", "BenchModelError", "call_model", "load_factory", "task_from_factory"]

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


def _split(text: str) -> tuple[str, str]:
    module, sep, name = text.partition(":")
    if not sep or not module or not name.isidentifier():
        raise BenchModelError(
            f"--model {text!r}: give {FORM}, e.g. --model mypkg.models:make_bench_model."
        )
    return module, name


def load_factory(text: str) -> Callable[[], Any]:
    """Import the factory ``package.module:factory``.

    Raises:
        BenchModelError: a malformed name, a module that does not import, or a name that is
            missing or not callable.
    """
    module_name, name = _split(text)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BenchModelError(
            f"--model {text!r}: cannot import {module_name!r} ({exc}); run from the directory "
            "that holds it or add that directory to PYTHONPATH (on every node)."
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
