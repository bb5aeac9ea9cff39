"""The buckets DiLoCo hands the quantized hook: :class:`FlatBucket`, a fragment's outer gradient
with a bucket's methods. They live with the quantized hook (:mod:`commhooks.hooks.quantized.
buckets`), which also cuts the first step after a restart as the saved run's buckets were;
``WarmupBuckets`` is the name that cut had here, kept so that averagers pickled by earlier
releases unpickle.
"""

from commhooks.hooks.quantized.buckets import FlatBucket, SavedBuckets, parse_buckets, split

__all__ = ["FlatBucket", "WarmupBuckets", "parse_buckets", "split"]

WarmupBuckets = SavedBuckets
