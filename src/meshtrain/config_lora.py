"""`model.lora`: PEFT's `LoraConfig` fields as meshtrain takes them, parsed and checked
with the `model` group (`config.ModelConfig.lora`)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from meshtrain.config_parsing import ConfigError, parse


@dataclass(frozen=True)
class LoraSettings:
    """`model.lora`: PEFT's `LoraConfig` fields under their PEFT names, so a config written
    for PEFT carries over. Only what meshtrain implements is accepted."""

    r: int = 8
    lora_alpha: float = 8
    lora_dropout: float = 0.0
    # PEFT's meaning: a list of module names (a name matches a module whose dotted name
    # is it or ends with "." + it), one string (a regular expression the whole dotted name
    # must match), "all-linear" (every Linear but the LM head), or null (PEFT's default
    # for the model type: q_proj and v_proj in the Llama family).
    target_modules: str | list[str] | None = None
    # PEFT's meaning: parameters adapted directly (a name matches a parameter whose dotted
    # name is it or ends with "." + it): a mixture of experts' routers (gate.weight) and
    # 3-D experts (gate_up_proj, down_proj); see `models.parameter_targets`.
    target_parameters: list[str] | None = None
    use_rslora: bool = False  # scale by alpha / sqrt(r) instead of alpha / r
    # PEFT's meaning: modules trained whole beside the adapters (a name matches a module
    # whose dotted name is it or ends with "." + it), e.g. [lm_head] for new chat tokens.
    modules_to_save: list[str] | None = None
    # LoRA on a randomly initialised model trains a low-rank update of noise: refused
    # unless this is set (e.g. to test a layout without a pretrained folder).
    allow_random_base: bool = False

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (self.r**0.5 if self.use_rslora else self.r)

    @classmethod
    def from_params(cls, values: dict[str, Any], group: str = "model.lora") -> LoraSettings:
        """`model.lora` as written (PEFT's names), parsed and checked; the settings keep
        the mapping they were read from for `to_params`."""
        settings = parse(cls, peft_only_defaults(values), group)
        check_lora(settings)
        object.__setattr__(settings, "_given", copy.deepcopy(dict(values)))
        return settings

    def to_params(self) -> dict[str, Any]:
        """The `model.lora` mapping these settings were read from, as written (so that
        `RunConfig.to_dict()`, which plan.json's hash is made of, says what the user
        wrote, as when `model.lora` was kept as a dict); every field where they were
        built in code."""
        given = getattr(self, "_given", None)
        return copy.deepcopy(given) if given is not None else dataclasses.asdict(self)


# PEFT LoraConfig fields meshtrain does not implement: refused by name, not as typos.
_PEFT_UNSUPPORTED = (
    "use_dora",
    "layers_to_transform",
    "layers_pattern",
    "rank_pattern",
    "alpha_pattern",
    "init_lora_weights",
    "fan_in_fan_out",
    "exclude_modules",
    "lora_bias",
    "trainable_token_indices",
    "use_qalora",
)


def peft_only_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """`model.lora` without the PEFT fields that carry over as meshtrain's only behaviour
    (task_type CAUSAL_LM, bias none); the PEFT features meshtrain lacks are refused."""
    values = dict(values)
    if values.get("task_type", "CAUSAL_LM") not in (None, "CAUSAL_LM"):
        raise ConfigError(
            f"`model.lora.task_type` is {values['task_type']!r}; meshtrain trains causal "
            "language models: CAUSAL_LM (or leave it out)."
        )
    if values.get("bias", "none") != "none":
        raise ConfigError(
            f"`model.lora.bias` is {values['bias']!r}; meshtrain trains no biases of the "
            "base: use none (PEFT's default)."
        )
    if values.get("ensure_weight_tying"):
        raise ConfigError(
            "`model.lora.ensure_weight_tying` is true: PEFT then makes the embedding's and "
            "the LM head's adapters one storage held by two trainable parameters, which "
            "AdamW steps twice (twice the learning rate). meshtrain follows PEFT's default "
            "instead: the head shares the frozen base weight, each layer named in "
            "target_modules gets its own adapter. Remove it (or set it to false)."
        )
    for name in ("task_type", "bias", "ensure_weight_tying"):
        values.pop(name, None)
    for name in _PEFT_UNSUPPORTED:
        if name in values:
            raise ConfigError(
                f"`model.lora.{name}`: PEFT's `{name}` is not implemented by meshtrain's LoRA "
                "(r, lora_alpha, lora_dropout, target_modules, target_parameters, "
                "modules_to_save and use_rslora are). Remove it."
            )
    return values


def check_lora(settings: LoraSettings) -> None:
    """Refuse `model.lora.*` values PEFT would refuse, or that would train nothing."""
    if settings.r < 1:
        raise ConfigError(
            f"`model.lora.r` is {settings.r}; the adapters' rank must be at least 1 (e.g. 16)."
        )
    if settings.lora_alpha <= 0:
        raise ConfigError(
            f"`model.lora.lora_alpha` is {settings.lora_alpha}; it must be positive (PEFT's "
            "usual choice is twice r)."
        )
    if not 0 <= settings.lora_dropout < 1:
        raise ConfigError(
            f"`model.lora.lora_dropout` is {settings.lora_dropout}; use a probability in "
            "[0, 1), e.g. 0.05 (1 would drop every input of the adapters)."
        )
    if settings.target_parameters is not None and not settings.target_parameters:
        raise ConfigError(
            "`model.lora.target_parameters` is empty; name a mixture of experts' parameters "
            "(e.g. [gate_up_proj, down_proj]) or leave it out."
        )
    if settings.modules_to_save is not None and not settings.modules_to_save:
        raise ConfigError(
            "`model.lora.modules_to_save` is empty; name the modules to train whole (e.g. "
            "[lm_head]) or leave it out."
        )
    if isinstance(settings.target_modules, list) and not settings.target_modules:
        if settings.target_parameters:
            return  # PEFT's way to adapt the parameters only
        raise ConfigError(
            "`model.lora.target_modules` is empty; name modules (e.g. [q_proj, v_proj]), "
            "use all-linear, or null for PEFT's default."
        )


def check_pretrained_base(settings: LoraSettings, init_from: str | None) -> None:
    """LoRA on random weights learns a low-rank update of noise: refuse it unless forced."""
    if init_from is None and not settings.allow_random_base:
        raise ConfigError(
            "`model.lora` is set but `model.init_from` is not: LoRA freezes the base model, "
            "so on random weights it would train a low-rank update of noise and learn "
            "little. Set model.init_from to a pretrained folder (e.g. "
            "data/06_models/consolidated after `kedro run`), or model.lora.allow_random_base"
            "=true to run it anyway (a test of a layout)."
        )
