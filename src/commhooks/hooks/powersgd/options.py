"""The options of the PowerSGD hooks, each spelled once, with its reason and its check."""

import dataclasses
from typing import Any, ClassVar

from commhooks.options import Options, flag, integer, nonfinite_option, option, real

__all__ = ["COSMETIC", "PowerSGDOptions"]

_every_step = integer(hint="steps between two logs of compression_stats(); 1 or less: every step")
_FLAG = flag(strict=False)  # numpy booleans and 0/1 too, as PyTorch's state takes them


def _stats_frequency(owner: str, name: str, value: Any) -> int:
    # PyTorch's state takes 0 or less to mean every step.
    return max(1, int(_every_step(owner, name, value)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PowerSGDOptions(Options):
    """How :func:`powerSGD_hook` and :func:`batched_powerSGD_hook` compress.

    The names and defaults are PyTorch's ``PowerSGDState`` arguments, plus ``single_round``
    and ``on_nonfinite``.
    ``matrix_approximation_rank`` and ``start_powerSGD_iter`` are the ones to tune.
    """

    owner: ClassVar[str] = "PowerSGDState"

    matrix_approximation_rank: int = option(
        1,
        "rank r of the factors; lower compresses more (try 1, 2, 4)",
        integer(minimum=1, hint="try 1, 2 or 4"),
    )
    start_powerSGD_iter: int = option(
        1_000,
        "plain allreduce for this many steps first: early training is sensitive to gradient "
        "error (0 compresses from the first step)",
        integer(minimum=0, hint="0 compresses from the first step"),
    )
    min_compression_rate: float = option(
        2,
        "a matrix is compressed only if its factors are at least this many times smaller",
        real(
            minimum=1,
            finite=False,
            keep_int=True,
            hint="a rate below 1 would 'compress' a matrix into factors larger than itself",
        ),
    )
    use_error_feedback: bool = option(
        True, "remember what compression dropped and add it to the next gradient", _FLAG
    )
    warm_start: bool = option(True, "start each power iteration from the last factors", _FLAG)
    orthogonalization_epsilon: float = option(
        0.0,
        "added to column norms when orthogonalising; zero columns need none here",
        real(minimum=0, hint="0 is exact; zero columns are handled without it"),
    )
    random_seed: int = option(
        0,
        "seed of the random projections, the same on every rank",
        integer(minimum=0, maximum=2**32 - 1),
    )
    compression_stats_logging_frequency: int = option(
        10_000, "log compression_stats() every this many steps", _stats_frequency
    )
    batch_tensors_with_same_shape: bool = option(
        False,
        "compress same-shaped matrices with batched products (stacking them costs a copy: "
        "it pays on GPUs with many small layers)",
        _FLAG,
    )
    single_round: bool = option(
        False,
        "one collective per bucket and step instead of two, refining P and Q on alternate "
        "steps: half the latency, slower convergence at the same rank (needs warm_start)",
        _FLAG,
    )

    on_nonfinite: str = nonfinite_option()

    def check_together(self) -> None:
        if self.single_round and not self.warm_start:
            raise ValueError(
                f"{self.owner}: single_round=True needs warm_start=True: each step refines one "
                "factor starting from the other one of the previous step. Set warm_start=True "
                "or single_round=False; got single_round=True."
            )


COSMETIC = ("compression_stats_logging_frequency", "start_powerSGD_iter", "on_nonfinite")
"""Options that may change across a restart without making the saved memory meaningless."""

PowerSGDOptions.__module__ = "commhooks.hooks.powersgd"  # what pickles and reprs name
