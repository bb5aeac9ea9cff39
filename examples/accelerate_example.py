"""Train with Accelerate and a commhooks hook, checkpoint, and resume.

Two processes on CPU (``accelerate launch --cpu`` starts a single process whatever
``--num_processes`` says, so ask for torchrun's launcher and tell Accelerate to stay on CPU):

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \
        examples/accelerate_example.py --hook fp16

On GPUs: ``accelerate launch --multi_gpu --num_processes 2 examples/accelerate_example.py``.
``--checkpoint DIR`` saves the state (model, optimizer, and every rank's hook state) after
training, trains on, then loads it back and checks that parameters and hook state came back.
"""

import argparse
import json

import torch
from accelerate import Accelerator
from torch import nn

from commhooks.config import hook_names, wrapper_names
from commhooks.integrations.accelerate import register_hook


def snapshot(model: nn.Module, state: object) -> list:
    """Parameters and hook state, to check that load_state brings both back."""
    hook_state = state.state_dict() if hasattr(state, "state_dict") else {}
    return [p.detach().clone() for p in model.parameters()] + [hook_state]


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", choices=hook_names(), default="fp16")
    parser.add_argument("--wrapper", choices=wrapper_names(), default="no")
    parser.add_argument("--options", type=json.loads, default={}, help="hook options as JSON")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--checkpoint", default=None, help="directory for save_state/load_state")
    args = parser.parse_args()

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = register_hook(accelerator, model, args.hook, args.wrapper, **args.options)

    gen = torch.Generator().manual_seed(accelerator.process_index)
    true_w = torch.randn(64, 1, generator=torch.Generator().manual_seed(42))
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=gen).to(accelerator.device)
        loss = nn.functional.mse_loss(model(x), x @ true_w.to(accelerator.device))
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            accelerator.print(f"step {step:3d}  loss {loss.item():.4f}  hook {args.hook}")

    if args.checkpoint:
        accelerator.save_state(args.checkpoint)
        saved = snapshot(model, state)
        for _ in range(3):  # move on, then come back
            loss = nn.functional.mse_loss(model(x), x @ true_w.to(accelerator.device))
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
        accelerator.load_state(args.checkpoint)
        ok = same(saved, snapshot(model, state))
        accelerator.print(f"restored {'ok' if ok else 'MISMATCH'}  state {type(state).__name__}")
    accelerator.end_training()
    if torch.distributed.is_initialized():  # Accelerate leaves it open; a clean exit closes it
        del model, optimizer, state
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
