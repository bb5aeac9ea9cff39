"""Train a LightningModule with a commhooks hook on 2 CPU processes, checkpoint included.

    python examples/lightning_example.py --hook fp16 --devices 2

``CommHookDDPStrategy`` registers the hook on CPU as well as GPU (Lightning's own
``DDPStrategy(ddp_comm_hook=...)`` does so only on CUDA) and saves every rank's hook state in
the checkpoint. On GPUs pass ``--accelerator gpu``.
"""

import argparse
import json

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from commhooks.config import hook_names, wrapper_names
from commhooks.integrations.lightning import CommHookDDPStrategy


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class SaveAndReport(L.Callback):
    """Runs in every training process, whichever way Lightning started them."""

    def __init__(self, checkpoint: str | None) -> None:
        self.checkpoint = checkpoint

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.checkpoint:
            trainer.save_checkpoint(self.checkpoint)  # includes every rank's hook state
        if trainer.is_global_zero:
            strategy = trainer.strategy
            loss = float(trainer.callback_metrics["train_loss"])
            print(f"trained {trainer.global_step} steps  loss {loss:.4f}")
            print(f"hook {strategy.hook_config.hook}/{strategy.hook_config.wrapper}")
            print(f"state {type(strategy.hook_state).__name__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", choices=hook_names(), default="fp16")
    parser.add_argument("--wrapper", choices=wrapper_names(), default="no")
    parser.add_argument("--options", type=json.loads, default={}, help="hook options as JSON")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--checkpoint", default=None, help="save a checkpoint to this file")
    parser.add_argument(
        "--start_method",
        default="popen",
        choices=["popen", "fork", "spawn"],
        help="how Lightning starts the other processes (fork: no re-import, CPU only)",
    )
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32 * args.steps * args.devices, 64, generator=gen)
    y = x @ torch.randn(64, 1, generator=gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=32)

    torch.manual_seed(0)
    strategy = CommHookDDPStrategy(
        args.hook, args.wrapper, hook_options=args.options, start_method=args.start_method
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[SaveAndReport(args.checkpoint)],
    )
    trainer.fit(Regression(), loader)


if __name__ == "__main__":
    main()
