"""How to shard the Llama family (Llama, Qwen2, Qwen3, Mistral) over tensor-parallel ranks.

Megatron's recipe on Hugging Face modules, expressed as DTensor parallel
styles: q/k/v and gate/up column-parallel, o/down row-parallel, the
embedding and LM head vocabulary-parallel (the LM head's output stays
vocabulary-sharded for `loss_parallel`). With sequence parallelism the
norms and residual stream stay sharded along the sequence; attention and
MLP gather it on entry and reduce-scatter it on exit. The hidden states
stay DTensors between layers so HF derives positions and masks from the
global sequence length.

Everything model-specific about tensor parallelism lives here; the generic
machinery is in `meshtrain.parallel.tensor_parallel`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from meshtrain.models.parameter_names import (  # noqa: F401  (re-exported)
    is_kv_projection,
    is_tensor_parallel_sharded,
    kv_replication_factor,
)


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
    if hasattr(model.model, "embed_tokens"):
        plan["model.embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=residual, use_local_output=not sp
        )
    if hasattr(model, "lm_head"):
        plan["lm_head"] = ColwiseParallel(
            input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
        )
    if sp and hasattr(model.model, "norm"):
        plan["model.norm"] = SequenceParallel()
    for index, _ in decoder_layers(model):
        layer = f"model.layers.{index}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{layer}.self_attn.{name}"] = ColwiseParallel()
        plan[f"{layer}.self_attn.o_proj"] = RowwiseParallel(
            output_layouts=residual, use_local_output=not sp
        )
        plan[f"{layer}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{layer}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{layer}.mlp.down_proj"] = RowwiseParallel(
            output_layouts=residual, use_local_output=not sp
        )
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
        plan[f"{layer}.mlp"] = PrepareModuleInput(
            input_layouts=(residual,),
            desired_input_layouts=(Replicate(),),
            use_local_output=False,
        )
    return plan


def replicate_kv_heads(model: nn.Module, factor: int) -> list[str]:
    """Repeat every KV head `factor` times in k_proj/v_proj; returns the parameter names.

    Copies of one head sit next to each other, so after column sharding the
    ranks whose query heads share that KV head hold a copy of it. Gradients of
    the copies are summed across those ranks before the update (see
    `parallel.tensor_parallel`), which keeps the copies identical and equal to
    training the original head.
    """
    if factor == 1:
        return []
    names = []
    for index, layer in decoder_layers(model):
        attention = layer.self_attn
        head_dim = attention.head_dim
        for proj_name in ("k_proj", "v_proj"):
            proj: nn.Linear = getattr(attention, proj_name)
            heads = proj.out_features // head_dim
            wider = nn.Linear(
                proj.in_features,
                heads * factor * head_dim,
                bias=proj.bias is not None,
                dtype=proj.weight.dtype,
                device=proj.weight.device,
            )
            with torch.no_grad():
                weight = proj.weight.view(heads, 1, head_dim, -1).expand(-1, factor, -1, -1)
                wider.weight.copy_(weight.reshape(heads * factor * head_dim, -1))
                if proj.bias is not None:
                    bias = proj.bias.view(heads, 1, head_dim).expand(-1, factor, -1)
                    wider.bias.copy_(bias.reshape(-1))
            setattr(attention, proj_name, wider)
            prefix = f"model.layers.{index}.self_attn.{proj_name}"
            names.append(f"{prefix}.weight")
            if proj.bias is not None:
                names.append(f"{prefix}.bias")
        # Query heads per (replicated) KV head; sdpa's repeat_kv reads it.
        attention.num_key_value_groups //= factor
    return names


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


class LlamaStage(nn.Module):
    """One pipeline stage of a Llama-family causal LM, with Hugging Face parameter names.

    The first stage holds the embedding, the last the final norm and LM head;
    every stage holds the rotary embedding (no parameters) and computes the
    positions of the whole block itself. Between stages travel plain tensors:
    with sequence parallelism, this rank's sequence shard, rewrapped as a
    DTensor on arrival. The last stage returns its vocabulary shard of the
    logits for `loss_parallel`.
    """

    def __init__(
        self, model: nn.Module, layer_ids: range, *, is_first: bool, is_last: bool
    ) -> None:
        super().__init__()
        self.config = model.config
        self.is_first, self.is_last = is_first, is_last
        self.model = nn.Module()
        if is_first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layer_ids})
        self.model.rotary_emb = model.model.rotary_emb
        if is_last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head
        self.tp_mesh = None
        self.sequence_parallel = False

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            hidden = self.model.embed_tokens(inputs)
        elif self.sequence_parallel:
            hidden = DTensor.from_local(inputs, self.tp_mesh, [Shard(1)], run_check=False)
        else:
            hidden = inputs
        positions = torch.arange(hidden.shape[1], device=inputs.device).unsqueeze(0)
        position_embeddings = self.model.rotary_emb(hidden, positions)
        for layer in self.model.layers.values():
            # No mask: sdpa then applies the causal mask itself, as HF does for unpadded blocks.
            hidden = layer(
                hidden,
                attention_mask=None,
                position_ids=positions,
                position_embeddings=position_embeddings,
            )
        if self.is_last:
            hidden = self.lm_head(self.model.norm(hidden))
        return hidden.to_local() if isinstance(hidden, DTensor) else hidden
