"""Every process group the library creates inherits the timeout of the group it derives from.

(What that buys, a dead or stopped peer reported within that timeout, is tested with real
signals in ``test_faults``.)
"""

from datetime import timedelta

import torch.distributed as dist

from commhooks import comm
from commhooks.testing import run_on_ranks


def _timeouts(rank, world_size):
    world = dist.group.WORLD
    custom = dist.new_group([0, 1], timeout=timedelta(seconds=9))
    singles = [g for g in comm.new_groups([[0], [1]], world) if g is not None]
    from_custom = [g for g in comm.new_groups([[0], [1]], custom) if g is not None]
    groups = {
        "default": None,
        "follow-up of the default": comm.follow_up_group(world),
        "carved from the default": singles[0],
        "follow-up of a custom group": comm.follow_up_group(custom),
        "carved from a custom group": from_custom[0],
    }
    return {name: comm.group_timeout(g).total_seconds() for name, g in groups.items()}


def test_every_group_the_library_creates_inherits_its_parents_timeout():
    for seconds in run_on_ranks(_timeouts, 2, pg_timeout=17):
        assert seconds == {
            "default": 17,
            "follow-up of the default": 17,
            "carved from the default": 17,
            "follow-up of a custom group": 9,
            "carved from a custom group": 9,
        }
