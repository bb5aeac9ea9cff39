"""How a bucket is laid out for compression: which tensors are compressed, and in which order.

Nothing here communicates or keeps memory; :class:`PowerSGDState` caches the plans.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from commhooks.compress import lowrank

__all__ = ["Plan", "bucket_order"]


@dataclass(frozen=True)
class Plan:
    """The split of a bucket, in the order PyTorch draws projections: by shape, then position.

    Attributes:
        compressed: ``(tensor index, parameter number, n, m, r)`` of each matrix compressed.
        uncompressed: indices of the tensors sent as they are (vectors, small matrices).
        numel_before: elements of the bucket.
        numel_after: elements sent: both factors of each compressed matrix, and the rest.
    """

    compressed: tuple[tuple[int, int, int, int, int], ...]
    uncompressed: tuple[int, ...]
    numel_before: int
    numel_after: int

    @staticmethod
    def build(
        numbers: Sequence[int], grads: Sequence[torch.Tensor], rank: int, min_rate: float
    ) -> "Plan":
        """Plan a bucket whose gradients ``grads`` belong to parameters ``numbers``."""
        by_shape: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = {}
        uncompressed: list[int] = []
        before = after = 0
        for i, (number, grad) in enumerate(zip(numbers, grads)):
            n, m = lowrank.as_matrix(grad).shape
            r = lowrank.effective_rank(n, m, rank)
            full, small = lowrank.compression_sizes(n, m, r)
            before += full
            if lowrank.should_compress(n, m, r, min_rate):
                by_shape.setdefault((n, m), []).append((i, number, n, m, r))
                after += small
            else:
                uncompressed.append(i)
                after += full
        compressed = tuple(e for group in by_shape.values() for e in group)
        return Plan(compressed, tuple(uncompressed), before, after)


def bucket_order(
    layouts: dict[str, tuple[int, ...]], key: str, signature: tuple[int, ...]
) -> tuple[list[int] | None, bool]:
    """Where a whole-bucket state applies: the bucket's parameters in the state's order.

    The state of ``key`` was made for the parameters ``layouts[key]``. Where this bucket (of
    parameters ``signature``) holds them in another order (a fresh DDP's first step), the first
    value lists their positions in the state's order (``None``: the bucket's own). The second
    says that the bucket holds other parameters, so the state no longer applies (``layouts``
    then takes the new signature).
    """
    old = layouts.get(key)
    if old is None or old == signature:
        layouts[key] = signature
        return None, False
    if sorted(old) == sorted(signature) and len(set(old)) == len(old):
        where = {number: i for i, number in enumerate(signature)}
        return [where[number] for number in old], False
    layouts[key] = signature
    return None, True
