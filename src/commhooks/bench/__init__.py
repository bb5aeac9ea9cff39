"""``commhooks bench``: what each hook buys on a given network, measured.

Imported only by the command line (``commhooks bench``, ``python -m commhooks bench``), so
``import commhooks`` stays light. Modules: ``args`` (flags), ``tasks`` (what is trained),
``hookset`` (which hooks, with which settings), ``worker`` (one rank's loop), ``launcher``
(fresh rank processes per hook), ``netns`` (rate-limited private network), ``costmodel``
(ring-allreduce prediction), ``summary`` (rows and comparisons), ``report`` (table, JSON, PNG).
"""
