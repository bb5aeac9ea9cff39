"""Train with Accelerate and a commhooks hook, checkpoint, and resume.

    accelerate launch --cpu --num_processes 2 examples/accelerate_example.py --hook fp16

On GPUs drop ``--cpu``. ``--checkpoint DIR`` saves the state (model, optimizer, and every
rank's hook state) after training, then loads it back and checks it came back unchanged.
"""

import argparse
import json

import torch
from accelerate import Accelerator
from torch import nn

from commhooks.config import hook_names, wrapper_names
from commhooks.integrations.accelerate import register_hook


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
        before = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        accelerator.load_state(args.checkpoint)
        same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        accelerator.print(f"restored {'ok' if same else 'MISMATCH'}  state {type(state).__name__}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
