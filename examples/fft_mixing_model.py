"""An FFT-mixing encoder: FNet's Fourier token mixing and a GFNet-style learnable
spectral filter, in plain PyTorch (nothing downloaded).

Each block mixes tokens in the frequency domain instead of with attention:

* FNet: ``fft2(x).real`` over (sequence, hidden), which saves nothing complex (the
  transform is linear);
* a global filter: ``ifft2(fft2(x) * W).real`` with a learnable complex ``W`` (one per
  frequency), whose backward saves ``conj(fft2(x))``, a complex activation with the
  conjugate bit set: complex dtypes and conjugate views are what it checks;

then a LayerNorm'd residual and a GELU MLP. ``forward(x, targets)`` returns the mean
cross-entropy of a per-token classifier over ``classes``.

    from fft_mixing_model import fft_mixer_tiny
    model = fft_mixer_tiny()
    loss = model(torch.randn(2, 16, 32), torch.randint(0, 8, (2, 16)))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FFTMixer", "FFTMixerConfig", "fft_mixer_tiny"]


@dataclass(frozen=True, kw_only=True)
class FFTMixerConfig:
    dim: int = 256
    seq_len: int = 128
    layers: int = 4
    hidden: int = 1024
    classes: int = 16


class FourierBlock(nn.Module):
    def __init__(self, config: FFTMixerConfig) -> None:
        super().__init__()
        frequencies = (config.seq_len, config.dim)
        self.filter = nn.Parameter(torch.complex(torch.ones(frequencies),
                                                 0.02 * torch.randn(frequencies)))
        self.mix_norm = nn.LayerNorm(config.dim)
        self.ffn_norm = nn.LayerNorm(config.dim)
        self.fc1 = nn.Linear(config.dim, config.hidden)
        self.fc2 = nn.Linear(config.hidden, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        fnet = torch.fft.fft2(x.float()).real
        spectrum = torch.fft.fft2(x.float()) * self.filter[:t]
        gfnet = torch.fft.ifft2(spectrum).real
        x = self.mix_norm(x + (fnet + gfnet).type_as(x))
        return self.ffn_norm(x + self.fc2(F.gelu(self.fc1(x))))


class FFTMixer(nn.Module):
    """Per-token classifier over FFT-mixing blocks; ``forward(x, targets)`` -> loss."""

    def __init__(self, config: FFTMixerConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(FourierBlock(config) for _ in range(config.layers))
        self.head = nn.Linear(config.dim, config.classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def fft_mixer_tiny() -> FFTMixer:
    """Small enough to train in a test on CPU: d=32, 16 tokens, 2 blocks."""
    torch.manual_seed(0)
    return FFTMixer(FFTMixerConfig(dim=32, seq_len=16, layers=2, hidden=64, classes=8))
