"""ResNet-50 (torchvision-style, bottleneck v1.5) written in plain torch.

v1.5 puts the stride-2 of each downsampling bottleneck on the 3x3 convolution (as torchvision
does), not on the first 1x1. 25,557,032 parameters with the default 1000 classes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

INPUT_NAMES = ["input"]
OUTPUT_NAMES = ["logits"]
DYNAMIC_AXES = {"input": {0: "batch"}, "logits": {0: "batch"}}
STAGES = (3, 4, 6, 3)
EXPANSION = 4


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (strided) -> 1x1 expand, with a projection shortcut when needed."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * EXPANSION
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    """ResNet-50 classifier: NCHW float32 image -> [batch, num_classes] logits."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin, layers = 64, []
        for i, blocks in enumerate(STAGES):
            width = 64 * 2**i
            stage = []
            for b in range(blocks):
                stage.append(Bottleneck(cin, width, 2 if (b == 0 and i > 0) else 1))
                cin = width * EXPANSION
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _init_weights(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.weight, 1.0, 0.1)
            nn.init.normal_(m.bias, 0.0, 0.1)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.01)
            nn.init.normal_(m.bias, 0.0, 0.01)


@torch.no_grad()
def _calibrate_batchnorm(model: nn.Module, batches: int = 2, size: int = 112) -> None:
    """Give BatchNorm realistic running statistics (cumulative average over random images)."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    model.train()
    for _ in range(batches):
        model(torch.randn(4, 3, size, size))
    model.eval()


def build(num_classes: int = 1000) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build a seeded ResNet-50 in eval mode and example inputs for export."""
    model = ResNet50(num_classes)
    _init_weights(model)
    _calibrate_batchnorm(model)
    return model, (torch.randn(1, 3, 224, 224),)


def sample_inputs(batch: int, seq: int, rng: np.random.Generator, **_: object) -> dict:
    """Images ~ N(0, 1), float32 [batch, 3, 224, 224] (``seq`` is ignored)."""
    return {"input": rng.standard_normal((batch, 3, 224, 224), dtype=np.float32)}
