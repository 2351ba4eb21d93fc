"""A first run: a Lightning model trained on 2 CPU processes with OptimizedDDPStrategy and the measuring callbacks.

Run it with ``python examples/quickstart.py``; at the end rank 0 prints the findings and writes ddpopt_report.json.
"""

import torch
from lightning import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ddpopt import AMPMonitor, CommProfiler, OptimizedDDPStrategy, StragglerDetector


class Regressor(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(4096, 32)
    y = x.sin().sum(dim=1, keepdim=True)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        strategy=OptimizedDDPStrategy(comm_hook="int8"),  # or "fp16", "powersgd", "auto"
        callbacks=[CommProfiler(), StragglerDetector(), AMPMonitor()],
        log_every_n_steps=10,
    )
    trainer.fit(Regressor(), DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True))
