"""A Llama-style decoder in plain PyTorch, for "will it fit?" estimates and examples.

RMSNorm, rotary position embeddings, grouped-query attention through
``scaled_dot_product_attention``, a SwiGLU MLP, untied input/output embeddings; the
forward returns the mean next-token cross-entropy. Nothing is downloaded.

Rotary embeddings come in two formulations of the same rotation: ``rope="real"`` rotates
(x1, x2) halves with cos/sin tables; ``rope="complex"`` is the one torchtitan's Llama 3 and
DeepSeek-V3 use, written here from its public formula: ``freqs_cis = polar(1, t * f)``
indexed by position, and ``view_as_real(view_as_complex(x) * freqs_cis)``. Its backward
saves ``conj(freqs_cis)``, a view with the conjugate bit set (the case issue 41 found).

    from llama_model import Llama, llama_7b, llama_tiny
    model = llama_7b()              # 6.7 B parameters on the meta device: no memory spent
    report = hyper_offload.estimate(model, (tokens, targets), budget=16384)

Factories take no required argument, so the CLI can call them:
``hyper-offload estimate examples/llama_model.py:llama_7b --input-shape 1,4096 ...``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "LLAMA3_8B", "LLAMA_7B", "LONG_SEQ_LEN", "Llama", "LlamaConfig", "llama3_8b",
    "llama3_8b_chunked_loss", "llama3_8b_long", "llama3_8b_long_chunked_loss", "llama_7b",
    "llama_7b_2_layers", "llama_tiny", "llama_tiny_complex_rope",
]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of the model. ``dim`` must divide by ``heads``, ``heads`` by ``kv_heads``
    (``kv_heads < heads`` is grouped-query attention)."""

    vocab: int = 32000
    dim: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 32
    hidden: int = 11008
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    rope: str = "real"
    """``"real"`` (cos/sin halves) or ``"complex"`` (torchtitan's ``freqs_cis``)."""
    checkpoint_layers: int = 0
    """Run the first this many layers under ``torch.utils.checkpoint`` (non-reentrant):
    each saves only its input and recomputes its forward in the backward. ``layers``:
    full activation checkpointing; fewer: recompute where memory binds."""
    loss_chunks: int = 1
    """Compute the LM head and the cross-entropy in this many sequence chunks, each
    checkpointed: the logits of one chunk are alive at a time, in the forward and in the
    backward (which recomputes them). At long context the logits over the vocabulary are
    the step's largest tensor (128K tokens x 128K vocabulary in fp32: 64 GiB, whose
    backward needs as much again): the loss, not the layers, sets the activation floor."""

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(f"LlamaConfig: dim={self.dim} is not divisible by heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"LlamaConfig: heads={self.heads} is not divisible by kv_heads={self.kv_heads}"
            )
        if self.rope not in ("real", "complex"):
            raise ValueError(f"LlamaConfig: rope must be 'real' or 'complex', got {self.rope!r}")
        if not 0 <= self.checkpoint_layers <= self.layers:
            raise ValueError(f"LlamaConfig: checkpoint_layers must be in 0..{self.layers}, got "
                             f"{self.checkpoint_layers}")
        if self.loss_chunks < 1:
            raise ValueError(f"LlamaConfig: loss_chunks must be >= 1, got {self.loss_chunks}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(config: LlamaConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The rotation of each position: cos and sin of shape (seq_len, head_dim // 2), or
    for ``rope="complex"`` one complex ``freqs_cis`` of that shape, indexed by position as
    torchtitan does. Computed on the fly (no buffer, so a meta model needs no table)."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    positions = torch.arange(config.max_seq_len, device=device)[:seq_len]
    angles = torch.outer(positions.float(), inv_freq)
    if config.rope == "complex":
        freqs_cis = torch.polar(torch.ones_like(angles), angles)
        return (freqs_cis[positions],)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, *table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of the last dimension; x: (batch, heads, seq, head_dim). With cos and
    sin: the (x1, x2) halves; with one complex ``freqs_cis``: adjacent pairs as complex
    numbers (torchtitan's ``apply_rotary_emb``)."""
    if len(table) == 1:
        x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(x_complex * table[0]).flatten(-2).type_as(x)
    cos, sin = table
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        kv_dim = config.kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, *table: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, t, _ = x.shape
        # Heads as -1: under tensor parallel the projections return this rank's heads.
        q = self.wq(x).view(b, t, -1, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, *table), apply_rotary(k, *table)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=c.kv_heads != c.heads
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden, bias=False)
        self.w2 = nn.Linear(config.hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, checkpointed: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, *table: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self._forward, x, *table, use_reentrant=False)
        return self._forward(x, *table)

    def _forward(self, x: torch.Tensor, *table: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), *table)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only LM; ``forward(tokens, targets)`` returns the mean cross-entropy."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleList(
            Block(config, checkpointed=i < config.checkpoint_layers) for i in range(config.layers)
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"Llama: sequence length {t} > max_seq_len {self.config.max_seq_len}")
        x, table = self._embed(tokens)
        for layer in self.layers:
            x = layer(x, *table)
        return self._head_and_loss(x, targets)

    # The code before and after the layers lives in methods: where the layers are compiled
    # one by one inside a compiled model (hyper_offload.estimate's per-block layout), Dynamo
    # skips this frame (a graph break in a loop) but still compiles the frames it calls.
    def _embed(self, tokens: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return self.tok_embeddings(tokens), rotary_tables(self.config, tokens.shape[1],
                                                          tokens.device)

    def _head_and_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(x)
        if self.config.loss_chunks == 1:
            logits = self.output(hidden).float()
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        chunks = zip(hidden.chunk(self.config.loss_chunks, dim=1),
                     targets.chunk(self.config.loss_chunks, dim=1))
        total = sum(checkpoint(self._loss_sum, h, y, use_reentrant=False) for h, y in chunks)
        return total / targets.numel()

    def _loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed next-token cross-entropy of ``hidden``'s positions (the LM head inside)."""
        logits = self.output(hidden).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


LLAMA_7B = LlamaConfig()
"""Llama-2-7B's shape: 32 layers, d=4096, 32 heads, SwiGLU hidden 11008, vocab 32000."""

LLAMA3_8B = LlamaConfig(vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, hidden=14336,
                        max_seq_len=131072, rope_theta=500000.0)
"""Llama-3-8B's shape: 32 layers, d=4096, 32 heads, 8 KV heads, SwiGLU hidden 14336,
vocab 128256, up to 128K tokens."""


def _on_meta(config: LlamaConfig, dtype: torch.dtype) -> Llama:
    with torch.device("meta"):
        return Llama(config).to(dtype)


def llama_7b(dtype: torch.dtype = torch.bfloat16) -> Llama:
    """The 7B model on the meta device (no memory spent), bf16 by default."""
    return _on_meta(LLAMA_7B, dtype)


def llama_7b_2_layers(dtype: torch.dtype = torch.bfloat16) -> Llama:
    """7B width, 2 layers, on the meta device: a huge but quick estimate (tests)."""
    return _on_meta(replace(LLAMA_7B, layers=2), dtype)


def llama3_8b(layers: int = 32, loss_chunks: int = 1, dtype: torch.dtype = torch.bfloat16,
              *, checkpoint_layers: int = 0, max_seq_len: int | None = None) -> Llama:
    """Llama-3-8B's shape on the meta device; ``loss_chunks`` > 1 chunks the LM head and
    the loss (``LlamaConfig.loss_chunks``), which is what lowers the long-context floor;
    ``checkpoint_layers`` checkpoints the first layers; ``max_seq_len`` beyond 128K
    for what-if estimates."""
    config = replace(LLAMA3_8B, layers=layers, loss_chunks=loss_chunks,
                     checkpoint_layers=checkpoint_layers,
                     max_seq_len=max_seq_len or LLAMA3_8B.max_seq_len)
    return _on_meta(config, dtype)


def llama3_8b_chunked_loss(dtype: torch.dtype = torch.bfloat16) -> Llama:
    """``llama3_8b`` with its loss in 16 checkpointed chunks (for the CLI)."""
    return llama3_8b(loss_chunks=16, dtype=dtype)


LONG_SEQ_LEN = 1 << 22
"""Positions the ``llama3_8b_long`` factories allow (4M tokens): what-if estimates past
the 128K Llama-3-8B was trained to (rotary tables are computed on the fly: a meta or
fake step spends nothing on them)."""


def llama3_8b_long(dtype: torch.dtype = torch.bfloat16) -> Llama:
    """``llama3_8b`` with positions up to :data:`LONG_SEQ_LEN` (for the CLI:
    ``hyper-offload estimate examples/llama_model.py:llama3_8b_long --input-shape
    1,524288 ...``)."""
    return llama3_8b(dtype=dtype, max_seq_len=LONG_SEQ_LEN)


def llama3_8b_long_chunked_loss(dtype: torch.dtype = torch.bfloat16) -> Llama:
    """``llama3_8b_long`` with its loss in 64 checkpointed chunks (8K tokens each at
    512K, as ``benchmarks/long_context.py`` chunks it)."""
    return llama3_8b(loss_chunks=64, dtype=dtype, max_seq_len=LONG_SEQ_LEN)


def llama_tiny(dtype: torch.dtype = torch.float32, rope: str = "real",
               loss_chunks: int = 1) -> Llama:
    """A real (CPU) model small enough to train in a test: d=32, 2 layers, GQA."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64,
                         max_seq_len=64, rope=rope, loss_chunks=loss_chunks)
    return Llama(config).to(dtype)


def llama_tiny_complex_rope(dtype: torch.dtype = torch.float32) -> Llama:
    """``llama_tiny`` with torchtitan's complex rotary embedding."""
    return llama_tiny(dtype, rope="complex")
