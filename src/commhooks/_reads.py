"""Whether a hook reads a check back to the host on the spot, or keeps it on the device.

On a CPU reading a value back waits for nothing, so the hooks check there as they go (a sum of
each block of a memory, a clip counted for its warning). On a GPU the same read makes the host
wait until the device has caught up, at every bucket, so the hooks keep those checks on the
device instead (masks, NaN marks) and read once a step at most. :func:`as_on_a_gpu` makes CPU
tensors take the GPU's branch, so that CPU tests run it (with
:func:`commhooks.comm.completing_inline`, which enters it).
"""

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["are_free", "as_on_a_gpu"]

_on_a_gpu = False


def are_free(tensor: torch.Tensor) -> bool:
    """Whether reading a check on ``tensor`` back costs no wait: on a CPU, outside
    :func:`as_on_a_gpu`. (``is_cpu``, not the device's type: asked once a bucket, and making
    the device object costs the host a quarter of a microsecond.)"""
    return tensor.is_cpu and not _on_a_gpu


@contextlib.contextmanager
def as_on_a_gpu() -> Iterator[None]:
    """Within this block, checks on CPU tensors stay on the device as on a GPU (for tests)."""
    global _on_a_gpu
    before, _on_a_gpu = _on_a_gpu, True
    try:
        yield
    finally:
        _on_a_gpu = before
