"""PEFT's `target_parameters` on a mixture of experts: which routers and 3-D experts a
LoRA run adapts, at what rank, and under which names.

transformers 5 holds a sparse layer's router (`mlp.gate`, a module of its own, not a
Linear) and its experts as plain parameters: `mlp.gate.weight` (E x hidden),
`mlp.experts.gate_up_proj` (E x 2I x hidden) and `mlp.experts.down_proj` (E x hidden x
I). PEFT adapts them through `target_parameters`, and maps the module names a config
written for transformers 4 gave them (`gate`; `gate_proj`/`up_proj`/`down_proj`, or
Mixtral's `w1`/`w3`/`w2`; and so everything `all-linear` reached) onto these parameters:
gate and up fused into one adapter of twice the rank and twice alpha (the same
scaling), and the MLP's names taken out of the Linear targets, so the dense layers of a
mixture keep no MLP adapter. meshtrain reads a config the same way.

An adapted parameter `<module>.<p>` gets `<module>.lora_A.<p>` and `<module>.lora_B.<p>`:
for the experts A is (E, r, in) and B (E, out, r), the expert first, so expert
parallelism splits them as it splits the experts; for the router A is (r, hidden) and B
(E, r), PEFT's own names and shapes. PEFT's file lays the experts' adapters out
otherwise (`checkpoint.consolidate.peft_layout`). Pure Python: the planner reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from meshtrain.config import ConfigError, LoraSettings

ALL_LINEAR = "all-linear"
ROUTER_WEIGHT = "gate.weight"
GATE_UP, DOWN = "gate_up_proj", "down_proj"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# PEFT's map from a transformers-4 module name to the parameter that holds it now, and
# the names fused into gate_up_proj (PEFT's `_MOE_TARGET_MODULE_MAPPING`, `_MOE_FUSED_
# TARGETS`; Qwen3-MoE reads Qwen2-MoE's).
_MODULE_TO_PARAMETER = {
    "qwen3_moe": {
        "gate": ROUTER_WEIGHT,
        "gate_proj": GATE_UP,
        "up_proj": GATE_UP,
        "down_proj": DOWN,
    },
    "mixtral": {"gate": ROUTER_WEIGHT, "w1": GATE_UP, "w3": GATE_UP, "w2": DOWN},
}
_FUSED = {"qwen3_moe": ("gate_proj", "up_proj"), "mixtral": ("w1", "w3")}


@dataclass(frozen=True)
class ParameterTarget:
    """One adapted parameter's adapter: its rank and alpha (twice the run's for a fused
    gate_up_proj named through gate and up), and so its scaling."""

    rank: int
    alpha: float
    rslora: bool

    @property
    def scaling(self) -> float:
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)


@dataclass(frozen=True)
class ResolvedTargets:
    """A config's targets on a mixture of experts: the Linear layers' (None: the module
    rules of `models.shapes` as given) and the parameters' (short name -> adapter)."""

    modules: list[str] | str | None
    parameters: dict[str, ParameterTarget]


def resolve_targets(model_type: str, settings: LoraSettings) -> ResolvedTargets:
    """`settings`' targets as PEFT reads them for a `model_type` model (an unchanged
    ResolvedTargets for a dense one, which takes no target_parameters)."""
    mapping = _MODULE_TO_PARAMETER.get(model_type)
    if mapping is None:
        if settings.target_parameters:
            raise ConfigError(
                f"`model.lora.target_parameters` {settings.target_parameters!r}: it adapts a "
                f"mixture of experts' routers and experts, which this {model_type} model has "
                "none of. Name Linear layers in model.lora.target_modules instead."
            )
        return ResolvedTargets(settings.target_modules, {})
    modules, mapped = _map_module_names(model_type, mapping, settings)
    parameters = {name: _target(settings, 1) for name in settings.target_parameters or []}
    for name in set(mapped.values()):
        fused = name == GATE_UP and set(_FUSED[model_type]) <= set(mapped)
        parameters[name] = _target(settings, 2 if fused else 1)
    if parameters and settings.lora_dropout:
        raise ConfigError(
            f"`model.lora.lora_dropout` is {settings.lora_dropout} with adapters on a "
            f"mixture of experts' {', '.join(sorted(parameters))}: PEFT refuses dropout "
            "there (an adapter folded into a 3-D weight has no input of its own to drop). "
            "Set it to 0, or adapt the attention only: [q_proj, k_proj, v_proj, o_proj]."
        )
    return ResolvedTargets(modules, parameters)


def _target(settings: LoraSettings, factor: int) -> ParameterTarget:
    return ParameterTarget(settings.r * factor, settings.lora_alpha * factor, settings.use_rslora)


def _map_module_names(
    model_type: str, mapping: dict[str, str], settings: LoraSettings
) -> tuple[list[str] | None, dict[str, str]]:
    """The Linear targets left and {module name given: parameter it maps to}."""
    targets = settings.target_modules
    if targets is None:
        return None, {}
    if targets == ALL_LINEAR or targets == [ALL_LINEAR]:
        return list(ATTENTION), dict(mapping)
    if isinstance(targets, str):
        raise ConfigError(
            f"`model.lora.target_modules` {targets!r}: a regular expression on a mixture of "
            "experts reaches its routers and experts by the names transformers 4 gave them, "
            "which meshtrain does not resolve. List the names instead, e.g. [q_proj, k_proj, "
            "v_proj, o_proj, gate, gate_proj, up_proj, down_proj], or use all-linear."
        )
    mapped, left = {}, []
    for target in targets:
        old = next((o for o in mapping if target == o or target.endswith("." + o)), None)
        if old is None:
            left.append(target)
        else:
            mapped[old] = mapping[old]
    fused = [name for name in _FUSED[model_type] if name in mapped]
    if len(fused) == 1:
        (missing,) = set(_FUSED[model_type]) - set(fused)
        raise ConfigError(
            f"`model.lora.target_modules` names {fused[0]} without {missing}: the two are "
            f"one 3-D parameter ({GATE_UP}) in a {model_type} model, adapted together or not "
            f"at all. Add {missing} or leave {fused[0]} out."
        )
    return left, mapped


def parameter_adapters(
    model_type: str, parameters: Iterable[str], settings: LoraSettings
) -> dict[str, ParameterTarget]:
    """Each adapted parameter's full name -> its adapter, in the order of `parameters`
    (a model's parameter names); refuses a target_parameters entry naming none of them."""
    names = list(parameters)
    wanted = resolve_targets(model_type, settings).parameters
    for target in settings.target_parameters or []:
        if not any(_matches(name, target) for name in names):
            adaptable = sorted({n.rpartition(".mlp.")[2] for n in names if _adaptable(n)})
            raise ConfigError(
                f"`model.lora.target_parameters` names {target!r}, which is not a parameter "
                f"of this model. Its adaptable parameters: {', '.join(adaptable)}."
            )
    chosen = {}
    for name in names:
        target = next((t for t in wanted if _matches(name, t)), None)
        if target is not None:
            if not _adaptable(name):
                raise ConfigError(
                    f"`model.lora.target_parameters` reaches {name}: meshtrain adapts the "
                    "routers' and experts' parameters only (gate.weight, gate_up_proj, "
                    "down_proj); name Linear layers in model.lora.target_modules."
                )
            chosen[name] = wanted[target]
    return chosen


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _adaptable(name: str) -> bool:
    return name.endswith(
        (".mlp." + ROUTER_WEIGHT, f".mlp.experts.{GATE_UP}", f".mlp.experts.{DOWN}")
    )


def adapter_names(parameter: str) -> tuple[str, str]:
    """The names of parameter `parameter`'s A and B."""
    module, _, short = parameter.rpartition(".")
    return f"{module}.lora_A.{short}", f"{module}.lora_B.{short}"


def adapter_shapes(shape: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A's and B's shapes for a parameter of `shape`: (E, r, in), (E, out, r) for experts
    (E, out, in); (r, in), (out, r) for a 2-D weight."""
    *experts, out, inp = shape
    return (*experts, rank, inp), (*experts, out, rank)


def parameter_adapter_shapes(
    config: Any, shapes: dict[str, tuple[int, ...]], settings: LoraSettings
) -> dict[str, tuple[int, ...]]:
    """The adapters' names and shapes for the parameters of `shapes` the run adapts."""
    adapters: dict[str, tuple[int, ...]] = {}
    for name, target in parameter_adapters(config.model_type, shapes, settings).items():
        a, b = adapter_names(name)
        adapters[a], adapters[b] = adapter_shapes(shapes[name], target.rank)
    return adapters
