"""The options of the quantized hook, each spelled once, with its reason and its check."""

import dataclasses
import functools
from typing import Any, ClassVar

from commhooks import comm
from commhooks.compress import blocks
from commhooks.options import Options, flag, integer, nonfinite_option, one_of, option

__all__ = ["AUTO", "FLAT", "OWNER", "QuantizationOptions"]

OWNER = "QuantizationState"  # the options' owner, named in every message
AUTO, FLAT = "auto", "flat"


def _check_topology(owner: str, name: str, value: Any) -> "str | comm.Topology":
    if isinstance(value, str) and value in (AUTO, FLAT):
        return value
    try:
        found = comm.Topology.of(value)
    except ValueError as exc:
        raise ValueError(f"{owner}: {name}: {exc}") from None
    if found is not None:
        return found
    raise ValueError(
        f"{owner}: {name} must be 'auto' (two hops where the group spans machines of several "
        "ranks each), 'flat' (one exchange over every rank), a commhooks.Topology, its rank "
        "lists (one list of global ranks per machine: [[0, 1], [2, 3]]) or a 2-D DeviceMesh "
        f"of shape (machines, ranks within a machine); got {name}={value!r}."
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationOptions(Options):
    """The options of :class:`QuantizationState`, each checked when the state is built."""

    owner: ClassVar[str] = OWNER

    bits: int = option(
        8,
        "bits per element on the wire: 8 sends about a quarter of float32's bytes, 4 about an "
        "eighth with steps 18 times coarser",
        check=one_of(8, 4, hint="8 or 4"),
    )
    block_size: int = option(
        256,
        "elements sharing one float32 scale: smaller blocks follow the gradient's range more "
        "closely and send more scales (4 bytes a block)",
        check=integer(8, 1 << 20, hint="a multiple of 8, e.g. 128 or 256"),
    )
    packed: bool = option(
        False,
        "4 bits only: send codes of 13 levels packed eight to 30 bits, so that with 256-value "
        "blocks a value and its share of the scale take 3.875 bits on the wire, not 4.125 "
        "(steps 7/6 as coarse; error feedback sends what they leave out later)",
        check=flag(),
    )
    rounding: str = option(
        blocks.NEAREST,
        "'nearest' has the smallest error; 'stochastic' is unbiased, for use without error "
        "feedback",
        check=one_of(*blocks.ROUNDINGS),
    )
    error_feedback: bool = option(
        True,
        "remember what quantization dropped and add it to the next gradient, so that over steps "
        "nothing is lost (one float32 copy of the gradients, and a share of one per rank)",
        check=flag(strict=False),
    )
    warmup_steps: int = option(
        0, "average in full precision for this many steps first", check=integer(0)
    )
    random_seed: int = option(
        0,
        "seed of stochastic rounding (each rank's generators add its place in the exchange)",
        check=integer(0, 2**62),
    )
    on_nonfinite: str = nonfinite_option()
    topology: "str | comm.Topology" = option(
        AUTO,
        "'auto' sums within each machine first and sends only the machine's share across "
        "machines where the group spans two or more machines of two or more ranks each; "
        "'flat' exchanges over every rank; or the machines, as a commhooks.Topology or a 2-D "
        "DeviceMesh (machines, ranks within a machine)",
        check=_check_topology,
    )

    def check_together(self) -> None:
        if self.packed and (self.bits != 4 or self.block_size % 32):
            raise ValueError(
                f"{self.owner}: packed=True packs 4-bit codes 32 at a time: use bits=4 and a "
                f"block_size that is a multiple of 32 (e.g. 256), or packed=False; got "
                f"bits={self.bits}, block_size={self.block_size}."
            )
        if isinstance(self.topology, comm.Topology) and not self.topology.even:
            raise ValueError(
                f"{self.owner}: topology {self.topology.describe()} holds unequal numbers of "
                "ranks a machine, which a two-hop average cannot split evenly; give machines of "
                "equal size, or topology='flat'."
            )
        if self.block_size % 8:
            raise ValueError(
                f"{self.owner}: block_size must be a multiple of 8 (a block of 4-bit codes fills "
                f"whole bytes and its scale stays aligned), e.g. {self.block_size // 8 * 8 or 8}; "
                f"got block_size={self.block_size}."
            )

    @property
    def format(self) -> blocks.BlockFormat:
        """The block format these options describe (one object per format: asked several
        times a bucket, and a frozen dataclass costs the host a microsecond to make)."""
        return _format(self.bits, self.block_size, self.packed)


@functools.cache
def _format(bits: int, block: int, packed: bool) -> blocks.BlockFormat:
    return blocks.BlockFormat(bits, block, packed)


QuantizationOptions.__module__ = "commhooks.hooks.quantized"  # what pickles and reprs name
