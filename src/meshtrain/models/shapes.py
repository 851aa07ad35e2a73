"""A model's shapes from its config alone: every parameter's, every module's name, and a
LoRA run's adapters, without building the model.

The planner (and `python -m meshtrain plan`) reads shapes here only; the LoRA converter
selects its targets with the same rules (`select_lora_targets`), so what the planner
counts and refuses is what the converter makes and refuses. No torch import: a plan
costs no modelling code.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from meshtrain.config import ConfigError, LoraSettings
from meshtrain.models.llama.parameter_names import (
    EMBEDDING_ADAPTERS,
    HEAD_NORMS,
    LM_HEAD,
    llama_family_shapes,
)
from meshtrain.models.moe_config import sparse_layers
from meshtrain.models.parameter_targets import parameter_adapter_shapes, resolve_targets

# PEFT's default targets for the Llama family (its TRANSFORMERS_MODELS_TO_LORA_TARGET_
# MODULES_MAPPING), used when `model.lora.target_modules` is null.
DEFAULT_TARGETS = ("q_proj", "v_proj")
ALL_LINEAR = "all-linear"
# The vocabulary layers: adapted only when named (PEFT's all-linear leaves the LM head
# out, and an embedding is not a Linear layer).
EMBEDDING_MODULE, HEAD_MODULE = "embed_tokens", "lm_head"
VOCABULARY_LAYERS = (EMBEDDING_MODULE, HEAD_MODULE)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def parameter_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every trainable parameter's Hugging Face name and shape (`llama_family_shapes`)."""
    return llama_family_shapes(config)


def module_names(config: Any) -> list[str]:
    """Every submodule's dotted name, in the built model's `named_modules()` order."""
    names = ["model", "model.embed_tokens", "model.layers"]
    sparse = set(sparse_layers(config))
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        names += [layer, f"{layer}.self_attn"]
        names += [f"{layer}.self_attn.{p}" for p in _ATTENTION]
        if config.model_type in HEAD_NORMS:
            names += [f"{layer}.self_attn.q_norm", f"{layer}.self_attn.k_norm"]
        names += [f"{layer}.mlp", *(f"{layer}.mlp.{p}" for p in _mlp_modules(config, i in sparse))]
        names += [f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
    return [*names, "model.norm", "model.rotary_emb", "lm_head"]


def _mlp_modules(config: Any, sparse: bool) -> tuple[str, ...]:
    """A layer's MLP's submodules in `named_modules()` order: the dense projections, or a
    sparse layer's router (`gate`, not a Linear) and experts, in the model's order."""
    if not sparse:
        return (*_MLP, "act_fn")
    experts = ("experts", "experts.act_fn")
    return ("gate", *experts) if config.model_type == "mixtral" else (*experts, "gate")


def linear_features(config: Any) -> dict[str, tuple[int, int]]:
    """Each Linear layer's (in_features, out_features), in `named_modules()` order (the
    LM head too, which a tied model holds as a copy of the embedding's weight)."""
    shapes = parameter_shapes(config)
    weights = {**shapes, LM_HEAD: (config.vocab_size, config.hidden_size)}
    return {
        name: (weights[f"{name}.weight"][1], weights[f"{name}.weight"][0])
        for name in module_names(config)
        if name.rsplit(".", 1)[-1] in (*_ATTENTION, *_MLP, "lm_head")
    }


def select_lora_targets(
    linears: list[str], modules: list[str], settings: LoraSettings, model_type: str
) -> list[str]:
    """The layers `settings.target_modules` selects, with PEFT's matching rules: Linear
    layers, and the embedding where it is named (or matched by a regular expression);
    refuses a target the model does not have (naming the closest). On a mixture of
    experts the MLP's names go to the routers and experts instead
    (`models.parameter_targets`), and may leave no Linear target."""
    targets = settings.target_modules
    if any(name.endswith(".mlp.experts") for name in modules):
        targets = resolve_targets(model_type, settings).modules
        if targets == []:
            return []
    if targets is None:
        targets = list(DEFAULT_TARGETS)
    if targets == ALL_LINEAR or targets == [ALL_LINEAR]:
        return [n for n in linears if n.rsplit(".", 1)[-1] != HEAD_MODULE]
    layers = [*_embeddings(modules), *linears]
    if isinstance(targets, str):
        chosen = [n for n in layers if re.fullmatch(targets, n)]
        if not chosen:
            raise ConfigError(
                f"`model.lora.target_modules` {targets!r} (a regular expression, as PEFT reads "
                f"one string) matches no Linear layer; they are named like {linears[0]!r}. "
                "List module names instead, e.g. [q_proj, v_proj], or use all-linear."
            )
        return chosen
    short = sorted({n.rsplit(".", 1)[-1] for n in modules if n})
    adaptable = sorted({n.rsplit(".", 1)[-1] for n in layers})
    for target in targets:
        if not any(n == target or n.endswith("." + target) for n in layers):
            close = difflib.get_close_matches(target, short, n=3)
            hint = f" Closest: {', '.join(close)}." if close else ""
            raise ConfigError(
                f"`model.lora.target_modules` names {target!r}, which is not a Linear layer "
                f"or the embedding of this model.{hint} Its adaptable layers: "
                f"{', '.join(adaptable)}."
            )
    return [n for n in layers if any(n == t or n.endswith("." + t) for t in targets)]


def _embeddings(modules: list[str]) -> list[str]:
    return [n for n in modules if n.rsplit(".", 1)[-1] == EMBEDDING_MODULE]


def is_embedding(module: str) -> bool:
    """Whether a LoRA target is the input embedding (PEFT's `lora_embedding_A`/`_B`)."""
    return module.rsplit(".", 1)[-1] == EMBEDDING_MODULE


def embedding_adapter_names(module: str) -> tuple[str, str]:
    """An embedding's adapter parameters, PEFT's names: A (r x vocabulary), B (hidden x r)."""
    a, b = EMBEDDING_ADAPTERS
    return f"{module}.{a}", f"{module}.{b}"


def saved_module_shapes(
    config: Any, settings: LoraSettings, targets: list[str]
) -> dict[str, tuple[int, ...]]:
    """The parameters `settings.modules_to_save` trains whole (PEFT's matching rules), with
    their shapes; refuses a name no module has, a module that is also a LoRA target in
    `targets`, and a vocabulary layer of a tied model (its trained copy would need the
    tie undone in every stage and checkpoint: adapt it with target_modules instead)."""
    shapes = parameter_shapes(config)
    modules = module_names(config)
    tied = getattr(config, "tie_word_embeddings", False)
    saved: dict[str, tuple[int, ...]] = {}
    for wanted in settings.modules_to_save or []:
        chosen = [m for m in modules if m == wanted or m.endswith("." + wanted)]
        where = f"`model.lora.modules_to_save` names {wanted!r}"
        if not chosen:
            close = difflib.get_close_matches(
                wanted, sorted({m.rsplit(".", 1)[-1] for m in modules})
            )
            hint = f" Closest: {', '.join(close)}." if close else ""
            raise ConfigError(f"{where}, which is not a module of this model.{hint}")
        for module in chosen:
            if module in targets:
                raise ConfigError(
                    f"{where}, which target_modules adapts too: a module is trained whole "
                    "or through an adapter, not both. Leave it out of one of them."
                )
            if tied and module.rsplit(".", 1)[-1] in VOCABULARY_LAYERS:
                raise ConfigError(
                    f"{where}: this model ties its embedding and LM head, and a trained copy "
                    "of one would untie them. Adapt it with LoRA instead (target_modules: "
                    f"[..., {module.rsplit('.', 1)[-1]}]), or start from an untied model."
                )
            saved |= {n: shape for n, shape in shapes.items() if n.startswith(module + ".")}
    return saved


def lora_adapter_shapes(config: Any, settings: LoraSettings) -> dict[str, tuple[int, ...]]:
    """Each trained parameter's Hugging Face name and shape, as `LoraConverter` makes them
    (then the modules trained whole, `saved_module_shapes`). The adapters:
    A is r x in, B out x r, for every targeted Linear layer in module order (the
    embedding's A r x vocabulary, B hidden x r, PEFT's); then the
    adapters of a mixture's routers and experts (`models.parameter_targets`)."""
    linears = linear_features(config)
    shapes: dict[str, tuple[int, ...]] = {}
    names = module_names(config)
    targets = select_lora_targets(list(linears), names, settings, config.model_type)
    for name in targets:
        if is_embedding(name):
            a, b = embedding_adapter_names(name)
            shapes[a], shapes[b] = (settings.r, config.vocab_size), (config.hidden_size, settings.r)
            continue
        in_features, out_features = linears[name]
        shapes[f"{name}.lora_A.weight"] = (settings.r, in_features)
        shapes[f"{name}.lora_B.weight"] = (out_features, settings.r)
    adapted = parameter_adapter_shapes(config, parameter_shapes(config), settings)
    place = {name: i for i, name in enumerate(names)}  # in the model's module order
    by_module = sorted(adapted.items(), key=lambda item: place[item[0].split(".lora_")[0]])
    return {**shapes, **dict(by_module), **saved_module_shapes(config, settings, targets)}
