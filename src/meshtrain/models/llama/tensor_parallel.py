"""How to shard the Llama family (Llama, Qwen2, Qwen3, Mistral) over tensor-parallel ranks.

Megatron's recipe on Hugging Face modules, expressed as DTensor parallel
styles: q/k/v and gate/up column-parallel, o/down row-parallel, the
embedding and LM head vocabulary-parallel (the LM head's output stays
vocabulary-sharded for `loss_parallel`; a chunked loss's head scores its
tokens). With sequence parallelism the norms and residual stream stay
sharded along the sequence; attention and
MLP gather it on entry and reduce-scatter it on exit. The hidden states
stay DTensors between layers so HF derives positions and masks from the
global sequence length.

Everything model-specific about tensor parallelism lives here; the generic
machinery is in `meshtrain.distributed.tensor_parallel`; which modules are split
which way is written once in `parameter_names`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshtrain.distributed.kv_heads import repeat_kv_heads
from meshtrain.distributed.lora_parallel import (
    LoraColwiseParallel,
    LoraRowwiseParallel,
    LoraVocabParallelEmbedding,
    LoraVocabParallelLossHead,
)
from meshtrain.distributed.tensor_parallel import (
    ParameterSharding,
    VocabParallelEmbedding,
    VocabParallelLossHead,
    read_sharding,
)
from meshtrain.models.head_loss import ScoringHead
from meshtrain.models.llama.parameter_names import COLUMN_PARALLEL, ROW_PARALLEL
from meshtrain.models.lora import LoraEmbedding, LoraLayer


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(index as named in Hugging Face, layer) for the decoder layers this module holds.

    A whole model holds all of them in a ModuleList; a pipeline stage holds
    its share in a ModuleDict keyed by the same indices, so names still match.
    """
    return list(model.model.layers.named_children())


def tensor_parallel_plan(model: nn.Module, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Module name -> parallel style, for `parallelize_module` on the tp mesh.

    Works on a whole model or on a pipeline stage (only the parts it holds).
    """
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {}
    embedding = getattr(model.model, "embed_tokens", None)
    if embedding is not None:
        style = (
            LoraVocabParallelEmbedding
            if isinstance(embedding, LoraEmbedding)
            else VocabParallelEmbedding
        )
        plan["model.embed_tokens"] = style(
            input_layouts=Replicate(), output_layouts=residual, use_local_output=not sp
        )
    head = getattr(model, "lm_head", None)
    lora_head = isinstance(head, LoraLayer)
    if isinstance(head, ScoringHead):
        style = LoraVocabParallelLossHead if lora_head else VocabParallelLossHead
        plan["lm_head"] = style(input_layouts=residual)
    elif head is not None:
        style = LoraColwiseParallel if lora_head else ColwiseParallel
        plan["lm_head"] = style(
            input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
        )
    if sp and hasattr(model.model, "norm"):
        plan["model.norm"] = SequenceParallel()
    for index, decoder_layer in decoder_layers(model):
        layer = f"model.layers.{index}"
        sparse = is_sparse(decoder_layer)
        if sparse and not sp:
            raise ValueError(
                "tensor parallelism of a mixture of experts needs sequence parallelism"
            )
        for name in _split_projections(COLUMN_PARALLEL, sparse):
            lora = isinstance(model.get_submodule(f"{layer}.{name}"), LoraLayer)
            plan[f"{layer}.{name}"] = LoraColwiseParallel() if lora else ColwiseParallel()
        for name in _split_projections(ROW_PARALLEL, sparse):
            style = (
                LoraRowwiseParallel
                if isinstance(model.get_submodule(f"{layer}.{name}"), LoraLayer)
                else RowwiseParallel
            )
            plan[f"{layer}.{name}"] = style(output_layouts=residual, use_local_output=not sp)
        if sp:
            plan[f"{layer}.input_layernorm"] = SequenceParallel()
            plan[f"{layer}.post_attention_layernorm"] = SequenceParallel()
        # Attention and MLP take their input as one replicated DTensor (gathered from the
        # sequence shards under SP). q/k/v (gate/up) then share it, so their input
        # gradients add up as one partial sum and cross the tp ranks once per block: a
        # reduce-scatter with SP, an all-reduce without (Megatron's count), not once per
        # projection.
        plan[f"{layer}.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": residual},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        )
        plan[f"{layer}.mlp"] = (
            sparse_mlp_style()
            if sparse
            else PrepareModuleInput(
                input_layouts=(residual,),
                desired_input_layouts=(Replicate(),),
                use_local_output=False,
            )
        )
    return plan


def _split_projections(names: tuple[str, ...], sparse: bool) -> list[str]:
    """Of a layer's projections, those tp splits: a sparse layer's MLP has none of its
    own (its experts run whole, `sparse_mlp_style`)."""
    return [name for name in names if not (sparse and name.startswith("mlp."))]


def is_sparse(decoder_layer: nn.Module) -> bool:
    """Whether a decoder layer's MLP is a mixture of experts (a router and experts)."""
    return hasattr(decoder_layer.mlp, "experts")


def sparse_mlp_style() -> ParallelStyle:
    """A mixture of experts' MLP (router and experts) under sequence parallelism: whole
    on every tp rank, run on the rank's own sequence shard as plain tensors (Megatron's
    expert tensor parallelism of 1, which needs SP too). No collective enters or leaves
    it; its weights' gradients, partial over tp, are summed like the per-head norms'
    (`sequence_local_parameters`)."""
    shard = Shard(1)
    return PrepareModuleInputOutput(
        input_layouts=(shard,),
        desired_input_layouts=(shard,),
        use_local_input=True,
        output_layouts=(shard,),
        desired_output_layouts=(shard,),
        use_local_output=False,
    )


def sequence_local_parameters(model: nn.Module) -> list[str]:
    """The parameters of every sparse layer's MLP (router and experts): whole on every
    tp rank, each rank's gradient covering its sequence shard only."""
    return [
        f"model.layers.{index}.mlp.{name}"
        for index, layer in decoder_layers(model)
        if is_sparse(layer)
        for name, _ in layer.mlp.named_parameters()
    ]


def replicate_kv_heads(model: nn.Module, factor: int) -> list[str]:
    """Repeat every KV head `factor` times in k_proj/v_proj (and in their LoRA B, whose
    rows are the layer's outputs); returns the parameter names.

    Copies of one head sit next to each other, so after column sharding the
    ranks whose query heads share that KV head hold a copy of it. Gradients of
    the copies are summed across those ranks before the update (see
    `distributed.tensor_parallel`), which keeps the copies identical and equal to
    training the original head.
    """
    if factor == 1:
        return []
    names = []
    for index, layer in decoder_layers(model):
        attention = layer.self_attn
        head_dim = attention.head_dim
        for proj_name in ("k_proj", "v_proj"):
            prefix = f"model.layers.{index}.self_attn.{proj_name}"
            proj: nn.Linear = getattr(attention, proj_name)
            rows = [(proj, prefix)]
            if isinstance(proj, LoraLayer):
                rows.append((proj.lora_B, f"{prefix}.lora_B"))
            for linear, name in rows:
                names += _repeat_rows(linear, factor, head_dim, name)
        # Query heads per (replicated) KV head; sdpa's repeat_kv reads it.
        attention.num_key_value_groups //= factor
    return names


def _repeat_rows(linear: nn.Linear, factor: int, head_dim: int, name: str) -> list[str]:
    """Widen `linear` in place (its class and frozen state kept), each head's rows
    repeated `factor` times; the names of the parameters it changed."""
    changed = []
    for part in ("weight", "bias"):
        old = getattr(linear, part, None)
        if old is None:
            continue
        with torch.no_grad():
            wider = repeat_kv_heads(old, factor, head_dim)
        setattr(linear, part, nn.Parameter(wider, requires_grad=old.requires_grad))
        changed.append(f"{name}.{part}")
    linear.out_features *= factor
    return changed


def head_local_parameters(model: nn.Module) -> dict[str, str]:
    """Plain (unsharded) parameters that only ever see this rank's heads.

    Qwen3 normalises queries and keys per head with a shared weight; under
    tensor parallelism each rank's gradient of that weight covers only its
    own heads, so the ranks' gradients must be summed. Returns name -> "q"/"k".
    """
    found = {}
    for index, layer in decoder_layers(model):
        for kind in ("q", "k"):
            norm = getattr(layer.self_attn, f"{kind}_norm", None)
            if norm is not None and getattr(norm, "weight", None) is not None:
                found[f"model.layers.{index}.self_attn.{kind}_norm.weight"] = kind
    return found


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, kv_replication: int
) -> dict[str, ParameterSharding]:
    """Shard `model` (a whole model or a stage) in place over `tp_mesh`; returns each
    parameter's sharding by name."""
    replicated_kv = replicate_kv_heads(model, kv_replication)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    # Every rank holds the same full (or meta) tensors: each keeps its shard, nothing is sent.
    parallelize_module(
        model,
        tp_mesh,
        tensor_parallel_plan(model, sequence_parallel=sequence_parallel),
        src_data_rank=None,
    )
    if tied and hasattr(model, "lm_head") and hasattr(model.model, "embed_tokens"):
        # parallelize_module gave each module its own DTensor; both are vocab-sharded
        # on dim 0, so re-tying keeps one parameter whose gradient sums both uses.
        model.lm_head.weight = model.model.embed_tokens.weight
    return read_sharding(
        model,
        tp_mesh.size(),
        kv_replicated=replicated_kv,
        kv_replication=kv_replication,
        head_dim=decoder_layers(model)[0][1].self_attn.head_dim,
        head_local=head_local_parameters(model),
        sequence_local=sequence_local_parameters(model),
    )
