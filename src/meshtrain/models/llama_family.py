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
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def tensor_parallel_plan(model: nn.Module, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Module name -> parallel style, for `parallelize_module` on the tp mesh."""
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=residual, use_local_output=not sp
        ),
        "lm_head": ColwiseParallel(
            input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        plan["model.norm"] = SequenceParallel()
    for index in range(len(decoder_layers(model))):
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
            # Inside attention and MLP everything is local: gather the sequence first.
            plan[f"{layer}.self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            )
            plan[f"{layer}.mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            )
    return plan


def kv_replication_factor(num_key_value_heads: int, tensor_parallel_size: int) -> int:
    """How many copies of each KV head tp ranks need so every rank holds whole heads.

    1 when the KV heads divide evenly over the ranks; tp / kv when there are
    fewer KV heads than ranks (optimum-neuron's `kv_size_multiplier`).
    Raises ValueError when neither divides the other.
    """
    if num_key_value_heads % tensor_parallel_size == 0:
        return 1
    if tensor_parallel_size % num_key_value_heads == 0:
        return tensor_parallel_size // num_key_value_heads
    raise ValueError(
        f"num_key_value_heads={num_key_value_heads} and tensor_parallel_size="
        f"{tensor_parallel_size}: one must divide the other"
    )


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
    for index, layer in enumerate(decoder_layers(model)):
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
    for index, layer in enumerate(decoder_layers(model)):
        for kind in ("q", "k"):
            norm = getattr(layer.self_attn, f"{kind}_norm", None)
            if norm is not None and getattr(norm, "weight", None) is not None:
                found[f"model.layers.{index}.self_attn.{kind}_norm.weight"] = kind
    return found


def is_tensor_parallel_sharded(name: str) -> bool:
    """Whether parameter `name` is split over tp ranks (for the memory estimate)."""
    return name.endswith(
        (
            "q_proj.weight",
            "k_proj.weight",
            "v_proj.weight",
            "q_proj.bias",
            "k_proj.bias",
            "v_proj.bias",
            "o_proj.weight",
            "gate_proj.weight",
            "up_proj.weight",
            "down_proj.weight",
            "embed_tokens.weight",
            "lm_head.weight",
        )
    )


def is_kv_projection(name: str) -> bool:
    return name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"))
