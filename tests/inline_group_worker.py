"""Run by tests/test_inline_group.py in a process of its own: the inline backend is the
process's default group. Prints one JSON object of what it found."""

import json
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks import comm
from commhooks.testing import inline_group

warnings.simplefilter("ignore")
inline_group.init()
found = {"backend": dist.get_backend()}

tensor = torch.ones(3)
work = dist.all_reduce(tensor, async_op=True)
found["complete_when_issued"] = work.get_future().done()
gathered = torch.empty(2, 3)
dist.all_gather_into_tensor(gathered[:1], tensor * 2)
found["gathered"] = gathered[0].tolist()


def grads(attach, steps=3):
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(*(nn.Linear(8, 8) for _ in range(12))), bucket_cap_mb=0.0005)
    if attach is not None:
        attach(ddp)
    x = torch.randn(4, 8)
    for _ in range(steps):
        for p in ddp.parameters():
            p.grad = None
        ddp(x).sum().backward()
    return torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])


plain = grads(None)
# PyTorch's PowerSGD with many buckets hangs on gloo; here its futures complete as NCCL's do.
state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
found["torch_power_sgd_finite"] = bool(
    torch.isfinite(grads(lambda d: d.register_comm_hook(state, torch_powersgd.powerSGD_hook))).all()
)
with comm.completing_inline():
    ours = grads(lambda d: commhooks.register(d, "allreduce"))
    ours_fp16 = grads(lambda d: commhooks.register(d, "fp16"))
    ours_psgd = grads(lambda d: commhooks.register(d, "power_sgd", start_powerSGD_iter=2))
theirs_fp16 = grads(lambda d: d.register_comm_hook(None, torch_default.fp16_compress_hook))
found["allreduce_bitwise"] = torch.equal(ours, plain)
found["fp16_bitwise"] = torch.equal(ours_fp16, theirs_fp16)
found["power_sgd_finite"] = bool(torch.isfinite(ours_psgd).all())
print(json.dumps(found))
