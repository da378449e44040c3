"""Models for sequence tiling's compile tests: token-wise ops outweigh the weights (many
tokens, narrow layers), as at long context, so the floor is a token-wise op's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.llama_model import FeedForward, Llama, LlamaConfig, RMSNorm

SEQ = 128
"""Tokens per sequence: no dim of any weight has this extent."""

LLAMA = LlamaConfig(vocab=96, dim=16, layers=1, heads=2, kv_heads=1, hidden=48, max_seq_len=SEQ)
"""One Llama block (examples/llama_model.py) over 128 tokens."""


class TokenModel(nn.Module):
    """Embedding, an RMSNorm + SwiGLU block with its residual (examples/llama_model.py's),
    the LM head and the mean cross-entropy: every op token-wise, no attention (quick to
    compile)."""

    def __init__(self, config: LlamaConfig = LLAMA) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = FeedForward(config)
        self.head_norm = RMSNorm(config.dim, config.norm_eps)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.mlp(self.norm(x))
        logits = self.head(self.head_norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch._dynamo.disable
def _eager_chain(x: torch.Tensor) -> torch.Tensor:
    """Eager code between two compiled regions that holds 24 saved tensors of ``x``'s size
    until its backward (each ``tanh`` saves its output), with a small working set."""
    for _ in range(24):
        x = torch.tanh(x) + x
    return x


class EagerBetween(TokenModel):
    """:class:`TokenModel` with eager code between the block (region 0) and the LM head and
    loss (region 1): its saved bytes are held while region 1's backward runs, so the step's
    floor at region 1's ops is over what region 1 alone needs."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = _eager_chain(x + self.mlp(self.norm(x)))
        logits = self.head(self.head_norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_model(seed: int = 0) -> TokenModel:
    torch.manual_seed(seed)
    return TokenModel()


def llama(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(LLAMA)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, LLAMA.vocab, (1, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
