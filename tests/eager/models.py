"""Tiny models and a step driver shared by the eager-session tests.

Every model is small enough that a step takes milliseconds on one CPU core, yet has the
features whose numerics the session must not change: attention, LayerNorm, GELU,
dropout (seeded), in-place ops, views, activation checkpointing, BatchNorm running
statistics, and an LSTM.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x).float().pow(2).mean()


class TransformerBlock(nn.Module):
    """Pre-norm block: attention + MLP, dropout, an in-place residual add, views, and
    the MLP run under (non-reentrant) activation checkpointing."""

    def __init__(self, dim: int = 32, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(p)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        att = self.drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        h = x + self.drop(self.proj(y))
        out = self.ln2(h)
        out = checkpoint(self._mlp, out, use_reentrant=False)
        out.add_(h)  # in-place residual
        return out.float().pow(2).mean()


class CNN(nn.Module):
    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(channels)
        self.head = nn.Linear(channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)), inplace=True)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.mean(dim=(2, 3))).float().pow(2).mean()


class LSTMModel(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1]).float().pow(2).mean()


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]


CASES = {
    "mlp": Case("mlp", MLP, (16, 32)),
    "transformer": Case("transformer", TransformerBlock, (2, 8, 32)),
    "cnn": Case("cnn", CNN, (4, 3, 8, 8)),
    "lstm": Case("lstm", LSTMModel, (4, 6, 16)),
}


def make_pair(
    case: Case, dtype: torch.dtype, seed: int = 0, input_shape: tuple[int, ...] | None = None
) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """Two identical models (one for the session, one for the plain reference) + input."""
    torch.manual_seed(seed)
    model = case.build().to(dtype)
    x = torch.randn(input_shape or case.input_shape).to(dtype)
    return model, copy.deepcopy(model), x


def train_step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    """One step; seeded so dropout draws the same mask in both runs."""
    torch.manual_seed(1000 + step)
    opt.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss


def assert_same_state(model: nn.Module, ref: nn.Module, where: str) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), f"{where}: grad presence of {name}"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{where}: gradient of {name} differs"
        assert torch.equal(p, q), f"{where}: parameter {name} differs"
    for (name, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(b, c), f"{where}: buffer {name} differs"


def plain_peak_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Peak bytes of storages a plain (no session) step creates, by the meter."""
    from hyper_offload.runtime import DeviceMemoryMeter

    probe = copy.deepcopy(model)
    meter = DeviceMemoryMeter("cpu")
    torch.manual_seed(0)
    with meter:
        probe(x).backward()
    return meter.peak_bytes
