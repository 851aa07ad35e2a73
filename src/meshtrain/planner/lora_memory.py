"""What a LoRA run's adapters add to, and take from, a decoder layer's saved activations
(`StepShape.adapter_bytes_per_token`, `.unsaved_elements` and `.merged_weight_bytes`,
which `planner.memory` counts), and what the embedding's and the head's adapters keep
on the first and last stage (`.vocabulary_adapter_bytes`)."""

from __future__ import annotations

from meshtrain.models.llama.parameter_names import EMBEDDING_ADAPTERS
from meshtrain.planner.shapes import ModelShape


def lora_activation_terms(
    adapter_shapes: dict[str, tuple[int, ...]],
    m: ModelShape,
    *,
    tp: int,
    dropout: bool,
    value_bytes: int,
    mask_bytes: int,
) -> tuple[float, float]:
    """(adapter bytes, unsaved matmul-side elements) per token and decoder layer of a LoRA
    run (`StepShape.adapter_bytes_per_token`, `.unsaved_elements`).

    Each adapter keeps its rank-r intermediate for B's gradient and, with dropout, its own
    dropped copy of the layer input and the mask (`mask_bytes` an element: a bool on
    accelerators; torch's CPU dropout keeps its scaled noise in the input's dtype); a
    row-parallel layer's input is a tp shard. A frozen product keeps no input: without
    dropout the MLP's normed input is kept only when gate or up is adapted, the
    attention's when one of q/k/v is, down_proj's input when it is; with dropout the
    adapters keep their dropped copies instead, and none of the three is kept."""
    targets: dict[str, tuple[int, ...]] = {
        name.split(".layers.0.")[1].split(".lora_A")[0]: shape
        for name, shape in adapter_shapes.items()
        if ".layers.0." in name and _on_tokens(name)
    }
    adapter_bytes = 0.0
    for module, (rank, width) in targets.items():
        row_parallel = module.endswith(("o_proj", "down_proj"))
        adapter_bytes += rank * value_bytes
        if dropout:
            adapter_bytes += (width / tp if row_parallel else width) * (value_bytes + mask_bytes)
    adapted = set() if dropout else {module.rsplit(".", 1)[-1] for module in targets}
    unsaved = 0.0
    if not adapted & {"q_proj", "k_proj", "v_proj"}:
        unsaved += m.hidden
    if not adapted & {"gate_proj", "up_proj"}:
        unsaved += m.hidden
    if "down_proj" not in adapted:
        unsaved += m.intermediate / tp
    return adapter_bytes, unsaved


def _on_tokens(name: str) -> bool:
    """A Linear layer's A, which runs on the tokens (a router's or the experts' adapters
    are folded into their weights: `merged_weight_bytes`)."""
    return name.endswith(".lora_A.weight") and not name.endswith(".mlp.gate.lora_A.weight")


def merged_weight_bytes(
    adapter_shapes: dict[str, tuple[int, ...]], layers: int, *, ep: int, value_bytes: int
) -> float:
    """Bytes per decoder layer (averaged over the layers) of the merged expert weights
    W + s B A a forward builds for each adapted 3-D parameter, as PEFT's ParamWrapper
    does: backward keeps them (recomputes them under activation checkpointing: not a
    matmul), and its gradient of one layer's is as large. E / ep experts a rank: A is
    (E, r, in) and B (E, out, r)."""
    elements = 0
    for name, (experts, _, width) in (
        (n, s) for n, s in adapter_shapes.items() if ".lora_A." in n and len(s) == 3
    ):
        out = adapter_shapes[name.replace(".lora_A.", ".lora_B.")][1]
        elements += experts // ep * out * width
    return elements * value_bytes / max(1, layers)


def vocabulary_adapter_bytes(
    adapter_shapes: dict[str, tuple[int, ...]],
    m: ModelShape,
    *,
    chunked_loss: bool,
    dropout: bool,
    value_bytes: int,
    mask_bytes: int,
) -> tuple[float, float]:
    """(first stage, last stage) bytes per token the vocabulary layers' adapters keep.

    The embedding's keeps its rank-r lookup for B's gradient (every rank looks up every
    token: the ids are whole under tp). The head's keeps its rank-r intermediate, and
    its input for A's gradient (whole, gathered under tp): the frozen head's own matmul
    keeps that input already without a chunked loss, not with one (which keeps
    gradients instead); with dropout, its dropped copy and the mask (PEFT drops a head's
    adapter input, not an embedding's)."""
    first = last = 0.0
    for name, shape in adapter_shapes.items():
        if name.endswith(f".embed_tokens.{EMBEDDING_ADAPTERS[0]}"):
            first += shape[0] * value_bytes
        elif name == "lm_head.lora_A.weight":
            last += shape[0] * value_bytes
            if dropout:
                last += m.hidden * (value_bytes + mask_bytes)
            elif chunked_loss:
                last += m.hidden * value_bytes
    return first, last
