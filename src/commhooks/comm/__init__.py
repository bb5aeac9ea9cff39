"""Every collective the hooks and averagers issue, and every group they make, lives here (the
bench and the test harness, which start their own runs, set up their own groups).

Hooks and averagers say *what* to communicate; this package says *how* it is issued, the same
on every backend and device: the backend's own collectives (:mod:`.collectives`), the groups
they run on (:mod:`.groups`), follow-ups issued in the same order on every rank
(:mod:`.issuer`), and which ranks share a machine (:mod:`.topology`).
"""

from commhooks.comm import collectives, groups, issuer
from commhooks.comm.collectives import *  # noqa: F403
from commhooks.comm.groups import *  # noqa: F403
from commhooks.comm.issuer import *  # noqa: F403
from commhooks.comm.topology import Topology, TwoHops, two_hops
from commhooks.comm.topology import find as topology_of

__all__ = ["Topology", "TwoHops", "topology_of", "two_hops"]
__all__ += collectives.__all__ + groups.__all__ + issuer.__all__
