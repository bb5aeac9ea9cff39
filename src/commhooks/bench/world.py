"""Whether the bench runs under a launcher (torchrun, or a SLURM or Kubernetes job that starts
its ranks with it), and the world the launcher set up.

A launcher tells each process who it is through the environment. When all of ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR`` are set, the bench joins that world
(``env://``) instead of starting ranks of its own; when only some are, something is
misconfigured, and the bench says which are missing rather than guess. ``LOCAL_WORLD_SIZE``
(the ranks of this process's node) gives the cluster's shape: ``WORLD_SIZE / LOCAL_WORLD_SIZE``
machines of ``LOCAL_WORLD_SIZE`` ranks, as torchrun starts them.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass

from commhooks.bench.shape import Shape

__all__ = ["LAUNCHER_VARIABLES", "LauncherWorld", "launcher_world"]

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


@dataclass(frozen=True)
class LauncherWorld:
    """This process's place in a launcher's world.

    Attributes:
        rank: its rank among all processes.
        world_size: how many processes the launcher started, on every node.
        local_rank: its rank on its own node: the GPU it uses (``cuda:LOCAL_RANK``).
        master_addr: where rank 0 listens for the others.
        local_world_size: the processes on its node (``LOCAL_WORLD_SIZE``); ``None`` when the
            launcher did not say.
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    local_world_size: int | None = None

    @property
    def shape(self) -> Shape:
        """The machines the launcher started: ``LOCAL_WORLD_SIZE`` ranks each, where it divides
        ``WORLD_SIZE``; otherwise (not said, or nodes of unequal sizes) every rank taken as a
        machine of its own, which :attr:`shape_note` says."""
        local = self.local_world_size
        if local is None or self.world_size % local:
            return Shape.of_ranks(self.world_size)
        return Shape(self.world_size // local, local)

    @property
    def shape_note(self) -> str | None:
        """Why :attr:`shape` takes every rank as a machine, when it does against the facts."""
        local = self.local_world_size
        if local is None:
            return (
                "LOCAL_WORLD_SIZE is not set, so every rank is taken as a machine of its own; "
                "start the bench with torchrun, which says how many ranks share a node"
            )
        if self.world_size % local:
            return (
                f"LOCAL_WORLD_SIZE={local} does not divide WORLD_SIZE={self.world_size} (nodes "
                "of unequal sizes), so every rank is taken as a machine of its own"
            )
        return None


def launcher_world(environ: Mapping[str, str] | None = None) -> LauncherWorld | None:
    """The launcher's world when its variables are set; ``None`` when none of them is.

    ``MASTER_ADDR`` alone (left in a shell, say) is not a launcher: without ``RANK`` and
    ``WORLD_SIZE`` the bench starts its own ranks as usual.

    Raises:
        ValueError: some of the launcher's variables are set and others are not, or one is
            not a number where a number belongs; the message names them.
    """
    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [v for v in LAUNCHER_VARIABLES if not env.get(v)]
    if missing:
        raise ValueError(
            f"RANK or WORLD_SIZE is set, as a launcher sets it, but {', '.join(missing)} is "
            "not: start the bench with torchrun (`torchrun --nproc_per_node 2 -m commhooks "
            "bench`), or unset RANK and WORLD_SIZE to let it start its own local ranks."
        )
    try:
        rank, world, local = (int(env[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError:
        raise ValueError(
            "RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers, as torchrun sets them; got "
            f"RANK={env['RANK']!r}, WORLD_SIZE={env['WORLD_SIZE']!r}, "
            f"LOCAL_RANK={env['LOCAL_RANK']!r}."
        ) from None
    if not 0 <= rank < world or local < 0:
        raise ValueError(
            f"RANK={rank} must lie in 0..WORLD_SIZE-1 ({world - 1}) and LOCAL_RANK={local} must "
            "not be negative: start the bench with torchrun, which sets them consistently."
        )
    raw = env.get("LOCAL_WORLD_SIZE", "").strip()
    local_world = int(raw) if raw.isdigit() and int(raw) > 0 else None
    return LauncherWorld(rank, world, local, env["MASTER_ADDR"], local_world)
