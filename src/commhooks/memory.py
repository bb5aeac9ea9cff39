"""The error-feedback memories under their former module name, for code that imports them here.

They live in :mod:`commhooks.compress.error_feedback`, whose name says what they hold.
"""

from commhooks.compress.error_feedback import (
    Absorbed,
    ErrorFeedback,
    Key,
    LazyErrorFeedback,
    Plausible,
)

__all__ = ["Absorbed", "ErrorFeedback", "Key", "LazyErrorFeedback", "Plausible"]
