"""Tensor parallel (and FSDP2 x TP) plans for the example Llama, torchtitan's layout.

``parallelize_llama(model, tp_mesh, dp_mesh=None)`` shards ``llama_model.Llama`` in place:

* attention: ``wq``/``wk``/``wv`` column-wise, ``wo`` row-wise; SwiGLU: ``w1``/``w3``
  column-wise, ``w2`` row-wise (each rank holds ``heads / tp`` query heads and
  ``kv_heads / tp`` key/value heads, so ``tp`` must divide ``kv_heads``);
* sequence parallel: the embedding's output, both RMSNorms of every block and the final
  norm run on this rank's slice of the sequence (``Shard(1)``), and each block's
  attention and MLP gather it back (``PrepareModuleInput``);
* the output projection gathers the logits (``Replicate``): the loss is a plain
  cross-entropy on every rank.

With ``dp_mesh`` each block and the root are also ``fully_shard``-ed over it (2-D).
``parallelize_hf_llama`` does the same for Hugging Face ``LlamaForCausalLM`` (no sequence
parallel: its rotary and mask code wants the whole sequence on every rank).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["parallelize_hf_llama", "parallelize_llama"]


def _check_heads(heads: int, kv_heads: int, tp: int) -> None:
    if kv_heads % tp:
        raise ValueError(
            f"tensor parallel over {tp} ranks needs kv_heads divisible by {tp}, got "
            f"heads={heads}, kv_heads={kv_heads}; pick a tp degree that divides kv_heads"
        )


def _block_plan(sequence_parallel: bool) -> dict[str, Any]:
    sharded_seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=sharded_seq),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=sharded_seq),
    }
    if sequence_parallel:
        plan.update({
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
            ),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
        })
    return plan


def parallelize_llama(
    model: nn.Module, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh | None = None,
    *, sequence_parallel: bool = True,
) -> nn.Module:
    """Shard ``llama_model.Llama`` over ``tp_mesh`` (and FSDP2 over ``dp_mesh``), in place."""
    config = model.config
    _check_heads(config.heads, config.kv_heads, tp_mesh.size())
    sharded_seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=sharded_seq),
        "output": ColwiseParallel(input_layouts=sharded_seq, output_layouts=Replicate()),
    }
    if dp_mesh is not None:
        # torch 2.13: a row-wise sharded embedding under FSDP2 fails without offload
        # ("Please convert all Tensors to FakeTensors" in MaskBuffer.materialize_mask:
        # sharding propagation leaves a fake mask in the placement's shared buffer). So
        # on a 2-D mesh the embedding is replicated over tp (FSDP2 still shards it) and
        # its output is sliced to this rank's part of the sequence.
        top["tok_embeddings"] = PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=sharded_seq
        )
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for block in model.layers:
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
    return _fully_shard(model, model.layers, dp_mesh)


def parallelize_hf_llama(
    model: nn.Module, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh | None = None
) -> nn.Module:
    """Shard Hugging Face ``LlamaForCausalLM`` over ``tp_mesh`` (explicit plan: attention
    and MLP projections, no sequence parallel) and FSDP2 over ``dp_mesh``, in place."""
    config = model.config
    _check_heads(config.num_attention_heads, config.num_key_value_heads, tp_mesh.size())
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, plan)
    return _fully_shard(model, model.model.layers, dp_mesh)


def _fully_shard(model: nn.Module, blocks: Any, dp_mesh: DeviceMesh | None) -> nn.Module:
    if dp_mesh is None:
        return model
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model
