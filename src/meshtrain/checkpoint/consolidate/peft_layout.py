"""meshtrain's adapters as PEFT names and lays them out, and as deltas of the stored
base tensors (the merged model).

A Linear layer's, an embedding's or a router's adapters are PEFT's already
(`<module>.lora_A.weight`, `<embedding>.lora_embedding_A`).
The experts' are held expert first, A (E, r, in) and B (E, out, r)
(`models.parameter_targets`); PEFT's `ParamWrapper` keeps A as one (E r) x in matrix
and B as out x (r E), B's columns running over the experts fastest, so its split over
expert-parallel ranks is strided. PEFT wraps a module once per adapted parameter, the
first of the module's parameters innermost: with both gate_up_proj and down_proj
adapted, gate_up_proj's adapters sit under `experts.base_layer.` and down_proj's under
`experts.`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from meshtrain.checkpoint.expert_layout import router_stored_name, stored_expert_names
from meshtrain.models.llama.parameter_names import EMBEDDING_ADAPTERS

PEFT_PREFIX = "base_model.model."
EMBEDDING_A, EMBEDDING_B = (f".{part}" for part in EMBEDDING_ADAPTERS)
# The experts module's parameters in registration order (both architectures).
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def _split(name: str) -> tuple[str, str, str]:
    """An adapter's (module, part, parameter): `m.lora_A.p` -> (m, lora_A, p)."""
    rest, _, parameter = name.rpartition(".")
    module, _, part = rest.rpartition(".")
    return module, part, parameter


def is_adapter(name: str) -> bool:
    """Whether a trained tensor is an adapter's (else a module trained whole,
    `modules_to_save`, under its base name)."""
    return ".lora_" in name


def is_expert_adapter(name: str) -> bool:
    return _split(name)[2] in _EXPERT_PARAMETERS


def peft_tensors(adapters: dict[str, Any]) -> dict[str, Any]:
    """`adapters` (meshtrain's names, whole tensors) under PEFT's keys and layouts."""
    adapted: dict[str, list[str]] = {}
    for name in adapters:
        if is_expert_adapter(name):
            module, _, parameter = _split(name)
            adapted.setdefault(module, [])
            if parameter not in adapted[module]:
                adapted[module].append(parameter)
    out = {}
    for name, tensor in adapters.items():
        if not is_expert_adapter(name):
            out[PEFT_PREFIX + name] = tensor
            continue
        module, part, parameter = _split(name)
        order = [p for p in _EXPERT_PARAMETERS if p in adapted[module]]
        wrappers = ".base_layer" * (len(order) - 1 - order.index(parameter))
        key = f"{PEFT_PREFIX}{module}{wrappers}.{part}.weight"
        out[key] = _peft_a(tensor) if part == "lora_A" else _peft_b(tensor)
    return out


def _peft_a(a: Any) -> Any:
    """(E, r, in) -> (E r, in)."""
    return a.reshape(-1, a.shape[-1]).contiguous()


def _peft_b(b: Any) -> Any:
    """(E, out, r) -> (out, r E), the expert fastest."""
    experts, out, rank = b.shape
    return b.permute(1, 2, 0).reshape(out, rank * experts).contiguous()


def is_router_adapter(name: str) -> bool:
    return _split(name)[0].endswith(".mlp.gate")


def target_parameters(adapters: list[str]) -> list[str]:
    """PEFT's `target_parameters` for these adapters: `gate.weight`, `experts.<p>`."""
    names = set()
    for name in adapters:
        if is_expert_adapter(name):
            names.add(f"experts.{_split(name)[2]}")
        elif is_router_adapter(name):
            names.add("gate.weight")
    return sorted(names)


def ranks(adapters: dict[str, Any], rank: int) -> dict[str, int]:
    """The adapted parameters whose adapters' rank is not `rank` (gate_up_proj named
    through gate and up: twice it) -> their rank, by PEFT's `target_parameters` name."""
    out = {}
    for name, tensor in adapters.items():
        if ".lora_A." in name and tensor.shape[-2] != rank:
            out[f"experts.{_split(name)[2]}"] = int(tensor.shape[-2])
    return out


def scalings(adapters: dict[str, Any], rank: int, alpha: float, rslora: bool) -> dict[str, float]:
    """Each A's scaling: alpha / r (or / sqrt r), alpha growing with the rank as PEFT's
    fused adapters' does."""
    out = {}
    for name, tensor in adapters.items():
        if ".lora_A." in name or name.endswith(EMBEDDING_A):
            r = int(tensor.shape[-2])
            out[name] = alpha * r / rank / (r**0.5 if rslora else r)
    return out


def stored_deltas(
    model_type: str, adapters: dict[str, Any], scaling: dict[str, float]
) -> dict[str, Callable[[], Any]]:
    """For each stored base tensor the adapters change, its change in fp32, computed when
    called (one at a time: the merge streams the base): s B A, of one expert for the
    experts, the rows of the part that tensor stores. `scaling`: per A name."""
    deltas = {}
    for a_name in adapters:
        if a_name.endswith(EMBEDDING_A):
            base = a_name.removesuffix(EMBEDDING_A) + ".weight"
            deltas[base] = partial(_embedding_delta, adapters, a_name, scaling[a_name])
            continue
        module, part, parameter = _split(a_name)
        if part != "lora_A":
            continue
        base = f"{module}.{parameter}"
        change = partial(_delta, adapters, a_name, scaling[a_name])
        experts = adapters[a_name].shape[0] if adapters[a_name].dim() == 3 else 0
        per_expert = stored_expert_names(model_type, experts, base) if experts else None
        if per_expert is None:
            deltas[router_stored_name(model_type, base)] = partial(change, None, 0, 1)
            continue
        for expert, parts in enumerate(per_expert):
            for index, stored in enumerate(parts):
                deltas[stored] = partial(change, expert, index, len(parts))
    return deltas


def _delta(
    adapters: dict[str, Any], a_name: str, scaling: float, expert: int | None, part: int, parts: int
) -> Any:
    a = adapters[a_name].float()
    b = adapters[a_name.replace(".lora_A.", ".lora_B.")].float()
    if expert is not None:
        a, b = a[expert], b[expert]
    return (scaling * (b @ a)).chunk(parts, dim=0)[part]


def _embedding_delta(adapters: dict[str, Any], a_name: str, scaling: float) -> Any:
    """An embedding's change, vocabulary x hidden: s (B A).T (PEFT's `get_delta_weight`)."""
    a = adapters[a_name].float()
    b = adapters[a_name.removesuffix(EMBEDDING_A) + EMBEDDING_B].float()
    return scaling * (b @ a).T
