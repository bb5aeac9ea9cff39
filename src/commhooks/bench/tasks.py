"""What the ranks train: a character-level language model on Python's own sources, or a
synthetic MLP sized for throughput runs.

The default task needs no download: every Python installation ships its standard library as
source text, so the same data exists on every machine (its exact content depends on the Python
version, which the report records together with a digest of the corpus). Files are split into
training and held-out sets by a hash of their relative path, so no file contributes to both.

Every batch is a pure function of ``(seed, rank, step)``: each rank sees different data, and
each hook sees exactly the same data as every other hook, so their losses are comparable.
"""

import hashlib
import math
import os
import re
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["TASKS", "Task", "make_task", "parse_params", "stdlib_corpus", "to_device"]

TASKS = ("stdlib-lm", "synthetic")
_CORPUS_BYTES = 1_500_000  # enough text for the short budgets here, quick to read
_HELDOUT_EVERY = 10  # about one file in ten is held out
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Task:
    """A model factory, a deterministic batch source and a held-out evaluation."""

    name: str
    model: nn.Module
    describe: dict[str, Any]
    train_batch: Callable[[int, int], Any]  # (rank, step) -> batch, a pure function
    heldout_batches: list[Any]
    # (batch, model) -> loss, for a model of the user's (``--model``); the built-in tasks'
    # batches are (inputs, classes), their loss the cross-entropy
    loss_fn: Callable[[Any, nn.Module], torch.Tensor] | None = None

    def loss(self, batch: Any, model: nn.Module) -> torch.Tensor:
        """The training loss of ``model`` on ``batch``."""
        if self.loss_fn is not None:
            return self.loss_fn(batch, model)
        inputs, targets = batch
        out = model(inputs)
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def heldout_loss(self, model: nn.Module, device: torch.device | None = None) -> float:
        """Mean loss over the fixed held-out batches (the same on every rank and hook), moved
        to ``device`` when given."""
        model.eval()
        batches = (to_device(b, device) for b in self.heldout_batches)
        losses = [float(self.loss(b, model)) for b in batches]
        model.train()
        return sum(losses) / len(losses)


def to_device(batch: Any, device: torch.device | None) -> Any:
    """``batch`` with every tensor in it (nested in tuples, lists and dicts) on ``device``;
    dtypes unchanged. ``None``: ``batch`` as it is."""
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def parse_params(text: str) -> int:
    """``"6M"`` -> 6_000_000, ``"500k"`` -> 500_000, ``"1.5e6"`` -> 1_500_000."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmg]?)", text.strip().lower())
    if not match:
        raise ValueError(f"bad --params {text!r}: use a count such as 6M, 500k or 2000000.")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    if not 1e4 <= value <= 2e9:
        raise ValueError(f"--params {text!r} is out of range: use 10k to 2G parameters.")
    return int(value)


def make_task(name: str, seed: int = 0, params: int = 6_000_000, batch_size: int = 0) -> Task:
    """Build the task ``name`` (one of ``TASKS``) with the model initialised from ``seed``."""
    if name == "stdlib-lm":
        return _stdlib_lm(seed, batch_size or 16)
    if name == "synthetic":
        return _synthetic(seed, params, batch_size or 32)
    raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}.")


# -- the default task: a character-level transformer on the standard library -------------------


def stdlib_corpus(limit: int = _CORPUS_BYTES) -> tuple[bytes, bytes, dict[str, Any]]:
    """Training and held-out text from the standard library's ``.py`` files.

    Files are taken in sorted order of their relative path (test suites and third-party
    packages excluded) until ``limit`` bytes are collected, which makes the choice identical
    on every run of the same Python.
    """
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests"))
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    paths.sort(key=lambda p: os.path.relpath(p, root))
    train: list[bytes] = []
    heldout: list[bytes] = []
    digest, used = hashlib.sha256(), 0
    for path in paths:
        if used >= limit:
            break
        rel = os.path.relpath(path, root)
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError:
            continue
        held = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % _HELDOUT_EVERY == 0
        (heldout if held else train).append(text)
        digest.update(rel.encode() + b"\0" + text)
        used += len(text)
    if not heldout or not train:
        raise RuntimeError(f"the standard library at {root} has too few .py files to train on.")
    info = {"root": root, "files": len(train) + len(heldout), "bytes": used}
    info["sha256"] = digest.hexdigest()[:16]
    return b"\n".join(train), b"\n".join(heldout), info


class CharTransformer(nn.Module):
    """A small pre-norm causal transformer over bytes (vocabulary 256)."""

    mask: torch.Tensor  # a buffer: moves with the model, not a parameter

    def __init__(self, context: int, width: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        out: torch.Tensor = self.head(self.norm(x))
        return out


def _windows(data: torch.Tensor, context: int, count: int, gen: torch.Generator) -> Batch:
    starts = torch.randint(0, data.numel() - context - 1, (count,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)
    rows = data[idx].long()
    return rows[:, :-1], rows[:, 1:]


def _stdlib_lm(seed: int, batch_size: int, context: int = 64) -> Task:
    train_text, heldout_text, info = stdlib_corpus()
    train = torch.frombuffer(bytearray(train_text), dtype=torch.uint8)
    heldout = torch.frombuffer(bytearray(heldout_text), dtype=torch.uint8)
    torch.manual_seed(seed)
    model = CharTransformer(context)

    def train_batch(rank: int, step: int) -> Batch:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
        return _windows(train, context, batch_size, gen)

    gen = torch.Generator().manual_seed(seed + 12345)
    heldout_batches = [_windows(heldout, context, 32, gen) for _ in range(4)]
    describe = {
        "kind": "character-level transformer LM on the Python standard library sources",
        "parameters": sum(p.numel() for p in model.parameters()),
        "context": context,
        "batch_per_rank": batch_size,
        "heldout_tokens": 4 * 32 * context,
        "corpus": info,
    }
    return Task("stdlib-lm", model, describe, train_batch, heldout_batches)


# -- the synthetic task: an MLP regression on a fixed random teacher -----------------------------


class _Teacher:
    """Targets are classes of a fixed random linear map, so the loss can actually fall."""

    def __init__(self, seed: int, dim: int, classes: int) -> None:
        gen = torch.Generator().manual_seed(seed + 777)
        self.weight = torch.randn(dim, classes, generator=gen) / math.sqrt(dim)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight).argmax(dim=1)


def _synthetic(seed: int, params: int, batch_size: int, dim: int = 256, depth: int = 4) -> Task:
    # depth-1 hidden square layers plus input and output layers: solve for the hidden width.
    a, b = depth - 1, 2 * dim + depth
    width = max(16, int((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)))
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(dim, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, dim))
    model = nn.Sequential(*layers)
    teacher = _Teacher(seed, dim, dim)

    def batch(gen: torch.Generator, n: int) -> Batch:
        x = torch.randn(n, dim, generator=gen)
        return x, teacher(x)

    def train_batch(rank: int, step: int) -> Batch:
        return batch(
            torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step), batch_size
        )

    gen = torch.Generator().manual_seed(seed + 12345)
    describe = {
        "kind": "synthetic MLP classifier on a fixed random teacher",
        "parameters": sum(p.numel() for p in model.parameters()),
        "width": width,
        "depth": depth + 1,
        "batch_per_rank": batch_size,
    }
    return Task("synthetic", model, describe, train_batch, [batch(gen, 256) for _ in range(4)])
