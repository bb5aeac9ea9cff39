"""``WarmupBuckets``, the name :class:`~commhooks.hooks.buckets.SavedBuckets` had here when only
streaming DiLoCo's warm-up kept the buckets it averaged: averagers pickled by earlier releases
name it."""

from commhooks.hooks.buckets import SavedBuckets

__all__ = ["WarmupBuckets"]

WarmupBuckets = SavedBuckets
