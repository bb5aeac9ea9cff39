"""Integrations with the ways DDP is launched and checkpointed.

Each submodule imports its framework only when it is imported itself:

* :mod:`commhooks.integrations.checkpoint`: per-rank hook state in single-file checkpoints
  (Accelerate, Lightning, ``torch.save`` on rank 0) and in ``torch.distributed.checkpoint``.
* :mod:`commhooks.integrations.accelerate`: Accelerate's ``DistributedDataParallelKwargs``
  with commhooks' hooks, or a hook registered on a model prepared by Accelerate.
* :mod:`commhooks.integrations.lightning`: a ``DDPStrategy`` that registers hooks on CPU too.
"""
