"""A small GPT written in plain PyTorch, shared by the examples and the benchmarks.

Nothing is downloaded: the weights are initialised from a seed. The architecture is the
usual pre-norm decoder (token + learned position embeddings, causal self-attention through
``scaled_dot_product_attention``, GELU MLP, tied input/output embeddings), so its saved
activations look like those of the models our users train: per block the LayerNorm
outputs, the QKV projection, the attention output, and the MLP's wide hidden state.

    from gpt_model import GPT, GPTConfig
    model = GPT(GPTConfig(layers=4, dim=128, heads=4, seq_len=256))
    loss = model(idx, targets)              # mean cross-entropy over every position
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "random_batch"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model; ``dim`` must be divisible by ``heads``."""

    vocab: int = 512
    seq_len: int = 128
    layers: int = 4
    dim: int = 128
    heads: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(f"GPTConfig: dim={self.dim} is not divisible by heads={self.heads}")


class Block(nn.Module):
    """One pre-norm decoder block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.ln1, self.ln2 = nn.LayerNorm(config.dim), nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.fc1 = nn.Linear(config.dim, 4 * config.dim)
        self.fc2 = nn.Linear(4 * config.dim, config.dim)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    """Decoder-only language model; ``forward(idx, targets)`` returns the mean loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.dim)
        self.pos = nn.Embedding(config.seq_len, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings, as in GPT-2
        for module in self.modules():  # GPT-2's initialisation: small logits at step 0
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def random_batch(
    config: GPTConfig, batch: int, *, seed: int = 0, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets drawn from a seeded generator (no data set needed)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.vocab, (batch, config.seq_len + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)
