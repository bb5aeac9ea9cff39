"""Sparse gradients (``nn.EmbeddingBag(..., sparse=True)``): averaged like DDP without a hook
by the hooks that can, refused with advice by those that compress. gloo, 2 and 3 ranks."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.testing import run_on_ranks

STEPS = 3


class SparseModel(nn.Module):
    """An embedding with sparse gradients (a bucket of its own in DDP) and a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.EmbeddingBag(50, 8, mode="sum", sparse=True)
        self.linear = nn.Linear(8, 4)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.linear(self.embedding(indices, offsets))


def _inputs(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randint(0, 50, (12,), generator=gen), torch.tensor([0, 4, 8])


def _gradients(model, rank):
    """Train a few SGD steps; each step's gradients, dense, one row per step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        model(*_inputs(rank, step)).pow(2).sum().backward()
        rows.append(torch.cat([p.grad.to_dense().reshape(-1) for p in model.parameters()]))
        opt.step()
    return torch.stack(rows)


def _ddp(hook=None, state=None):
    ddp = DDP(SparseModel(), bucket_cap_mb=0.004)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    return ddp


def _averaged(rank, world_size):
    registered = DDP(SparseModel(), bucket_cap_mb=0.004)
    commhooks.register(registered, "allreduce")
    post_local = commhooks.PostLocalSGDState(None, None, start_localSGD_iter=STEPS)
    sent = {
        "plain": _gradients(_ddp(), rank),
        "pytorch": _gradients(_ddp(torch_default.allreduce_hook), rank),
        "allreduce": _gradients(_ddp(commhooks.allreduce_hook), rank),
        "registered": _gradients(registered, rank),
        "post_local_warm_up": _gradients(_ddp(commhooks.post_localSGD_hook, post_local), rank),
    }
    kept = {
        "noop": _gradients(_ddp(commhooks.noop_hook), rank),
        "local": _gradients(SparseModel(), rank),
    }
    return sent, kept


@pytest.mark.parametrize("world_size", [2, 3])  # 3: dividing is not multiplying by 1/3
def test_sparse_gradients_average_like_ddp_without_a_hook(world_size):
    for sent, kept in run_on_ranks(_averaged, world_size):
        assert not torch.equal(sent["plain"], kept["local"]), "nothing was averaged"
        for name, grads in sent.items():
            if name == "pytorch" and world_size != 2:
                continue  # PyTorch's hook divides dense buckets, which DDP multiplies by 1/3
            assert torch.equal(grads, sent["plain"]), name
        assert torch.equal(kept["noop"], kept["local"])


REFUSING = {
    "fp16_compress_hook": lambda: (None, commhooks.fp16_compress_hook),
    "bf16_compress_hook": lambda: (None, commhooks.bf16_compress_hook),
    "fp16_compress_wrapper": lambda: (
        None,
        commhooks.fp16_compress_wrapper(commhooks.allreduce_hook),
    ),
    "bf16_compress_wrapper": lambda: (
        None,
        commhooks.bf16_compress_wrapper(commhooks.allreduce_hook),
    ),
    "powerSGD_hook": lambda: (
        commhooks.PowerSGDState(None, start_powerSGD_iter=0),
        commhooks.powerSGD_hook,
    ),
}


def _refused(rank, world_size):
    out = {}
    for name, make in REFUSING.items():
        state, hook = make()
        try:
            _gradients(_ddp(hook, state), rank)
            out[name] = "no error"
        except TypeError as exc:
            out[name] = str(exc)
        dist.barrier()  # every rank got here: none is left waiting in a collective
    return out


def test_compressing_hooks_refuse_sparse_gradients_naming_the_hooks_that_take_them():
    for out in run_on_ranks(_refused, 2, timeout=150, pg_timeout=30):
        for name, message in out.items():
            assert message.startswith(f"{name} cannot compress a sparse gradient"), message
            assert "allreduce_hook" in message and "sparse=False" in message, message
