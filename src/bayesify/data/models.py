"""The small CNN the demo trains as its "pretrained" network."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Conv-BN-ReLU ×3 and a linear classifier for ``[B, C, 8, 8]`` (or larger) images."""

    def __init__(self, num_classes: int = 5, in_channels: int = 1, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))

    def get_classifier(self) -> nn.Module:
        return self.fc


def train_map(
    model: nn.Module,
    loader: torch.utils.data.DataLoader,
    *,
    epochs: int = 30,
    lr: float = 3e-3,
    weight_decay: float = 5e-4,
    seed: int = 0,
    progress: bool = False,
) -> nn.Module:
    """Plain maximum-a-posteriori training (Adam + weight decay): the "pretrained" net."""
    from bayesify.progress import progress_bar

    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * len(loader))
    model.train()
    for _ in progress_bar(range(epochs), "MAP training", enabled=progress):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    return model
