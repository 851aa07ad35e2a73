"""How a mixture of experts' weights are stored in a Hugging Face folder.

In memory transformers 5 keeps a sparse layer's experts as two 3-D parameters,
`mlp.experts.gate_up_proj` (experts x 2 intermediate x hidden, each expert's gate rows
before its up rows) and `mlp.experts.down_proj` (experts x hidden x intermediate). On
disk, as its `save_pretrained` writes and every released checkpoint has them, each
expert's matrices are tensors of their own: `mlp.experts.{e}.gate_proj/up_proj/
down_proj.weight` for Qwen3-MoE; `block_sparse_moe.experts.{e}.w1/w3/w2.weight` for
Mixtral, whose router is stored as `block_sparse_moe.gate.weight`. `model.init_from`
reads that layout and consolidation writes it, so any transformers loads the folder.
"""

from __future__ import annotations

_EXPERTS = ".mlp.experts."
_ROUTER = ".mlp.gate.weight"
# Per architecture: where the experts are stored, and each 3-D parameter's parts in the
# order they stack along its second dimension.
_STORED = {
    "qwen3_moe": (
        ".mlp.experts",
        {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)},
    ),
    "mixtral": (".block_sparse_moe.experts", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
}


def stored_expert_names(model_type: str, experts: int, name: str) -> list[list[str]] | None:
    """For the 3-D experts parameter `name` of a `model_type` model, the tensors it is
    stored as: per expert, its parts in stacking order. None for any other parameter."""
    prefix, _, kind = name.partition(_EXPERTS)
    if model_type not in _STORED or kind not in ("gate_up_proj", "down_proj"):
        return None
    folder, parts = _STORED[model_type]
    return [[f"{prefix}{folder}.{e}.{part}.weight" for part in parts[kind]] for e in range(experts)]


def router_stored_name(model_type: str, name: str) -> str:
    """The name any other parameter is stored under (Mixtral's router moves)."""
    if model_type == "mixtral" and name.endswith(_ROUTER):
        return name.removesuffix(_ROUTER) + ".block_sparse_moe.gate.weight"
    return name


def stored_shapes(
    model_type: str, experts: int, shapes: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """The tensors a folder stores for parameters of `shapes`, with their shapes."""
    stored: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        per_expert = stored_expert_names(model_type, experts, name)
        if per_expert is None:
            stored[router_stored_name(model_type, name)] = shape
            continue
        rows = shape[1] // len(per_expert[0])
        stored.update({part: (rows, shape[2]) for parts in per_expert for part in parts})
    return stored
