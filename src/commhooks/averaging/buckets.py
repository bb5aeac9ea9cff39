"""The names :class:`FlatBucket` (a fragment's outer gradient with a bucket's methods) and the
cut of a restart's buckets (``WarmupBuckets``, now
:class:`~commhooks.hooks.buckets.SavedBuckets`) had here, kept so that averagers pickled by
earlier releases unpickle; both live in :mod:`commhooks.hooks.buckets`.
"""

from commhooks.hooks.buckets import FlatBucket, SavedBuckets, parse_buckets, split

__all__ = ["FlatBucket", "WarmupBuckets", "parse_buckets", "split"]

WarmupBuckets = SavedBuckets
