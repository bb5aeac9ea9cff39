"""A cluster's shape: machines of equal numbers of ranks, and where each rank of a run lives.

What crosses machines is what costs: ranks of one machine talk over NVLink, PCIe or shared
memory, machines over one network link each. The bench predicts per shape
(``--nnodes N --nproc-per-node G``, torchrun's words; a world of ``W`` ranks given with
``--world-size`` is ``W`` machines of one rank), reads the shape from the launcher under
torchrun, and runs the local ranks of a rate-limited check as machines of their own
(:func:`place_rank`). Ranks of one machine are consecutive, as torchrun numbers them.
"""

import os
from dataclasses import dataclass

__all__ = ["MACHINE_ID_VAR", "Shape", "place_rank"]

# The variable by which commhooks' topology tells machines apart (commhooks.comm's launch
# information): ranks with equal labels share a machine whatever their host names say.
MACHINE_ID_VAR = "COMMHOOKS_MACHINE_ID"


@dataclass(frozen=True, order=True)
class Shape:
    """``nodes`` machines of ``per_node`` ranks each.

    Attributes:
        nodes: machines, each with one link to the network (``--nnodes``).
        per_node: ranks in each machine (``--nproc-per-node``; GPUs, or CPU processes).
    """

    nodes: int
    per_node: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise ValueError(
                f"a cluster has at least one machine of one rank; got {self.nodes} machine(s) "
                f"of {self.per_node} rank(s)."
            )

    @property
    def ranks(self) -> int:
        """Every rank of every machine: torchrun's ``WORLD_SIZE``."""
        return self.nodes * self.per_node

    @property
    def key(self) -> str:
        """``"2x8"``: the shape's name in the JSON."""
        return f"{self.nodes}x{self.per_node}"

    def text(self) -> str:
        """``"2 machines x 8 ranks"``, ``"1 machine x 2 ranks"``: the shape in the report."""
        machines = "machine" if self.nodes == 1 else "machines"
        ranks = "rank" if self.per_node == 1 else "ranks"
        return f"{self.nodes} {machines} x {self.per_node} {ranks}"

    def machine_of(self, rank: int) -> int:
        """The machine of ``rank`` (ranks of one machine are consecutive)."""
        return rank // self.per_node

    @classmethod
    def of_ranks(cls, ranks: int) -> "Shape":
        """``ranks`` machines of one rank: how ``--world-size`` and ``--ranks`` count."""
        return cls(ranks, 1)


def place_rank(shape: Shape, machine_names: list[str], rank: int) -> None:
    """Tell rank ``rank``'s process which machine it is on, as a launcher would.

    Sets ``COMMHOOKS_MACHINE_ID`` (the machine's name: the topology of the hooks groups ranks by
    it), and torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``. Called in the rank's process
    before its process group is made (the hooks read the variables when they first run).
    """
    os.environ[MACHINE_ID_VAR] = machine_names[shape.machine_of(rank)]
    os.environ["LOCAL_RANK"] = str(rank % shape.per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(shape.per_node)
