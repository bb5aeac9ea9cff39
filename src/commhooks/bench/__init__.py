"""``commhooks bench``: what each hook buys on a given network, measured and predicted.

Imported only by the command line (``commhooks bench``, ``python -m commhooks bench``), so
``import commhooks`` stays light. A run reads top to bottom through its modules: ``args``
(flags, the plan), ``tasks`` (what is trained), ``hookset`` (which hooks, with which
settings), ``launcher`` (fresh rank processes per hook, through ``commhooks.testing``), or, under
torchrun, ``world`` and ``launched`` (the launcher's ranks, every hook in turn, on the
network measured by ``linkprobe``), ``usermodel`` (``--model``), ``clock`` (device time) and
``worker`` (one rank's loop), exchanging ``records`` (a run's specification, a rank's result);
``netns`` (rate-limited private links); ``rows`` (one row per hook and network), ``summary``
(ratios, time to accuracy, noise), ``costmodel`` and ``predict`` (step times on other links
and world sizes, from the loopback run), ``report`` (tables, answer, JSON) and ``plot`` (PNG).
"""

from pathlib import Path

# PyTorch's own hooks, the bench's baselines (``commhooks.bench.baselines``), have a source tree
# of their own beside the library's, which never imports them: ``baselines/`` in the
# repository, which the wheel places here. Run from a checkout, the bench finds them there.
_CHECKOUT_BASELINES = Path(__file__).parents[3] / "baselines" / "commhooks" / "bench"
if _CHECKOUT_BASELINES.is_dir():
    __path__.append(str(_CHECKOUT_BASELINES))
