"""`training.dpo`: direct preference optimization's settings, under TRL's names, parsed and
checked with the `training` group; and what a DPO run refuses about the rest of the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshtrain.config_parsing import ConfigError

LOSS_TYPES = ("sigmoid", "ipo", "robust")
REFERENCES = ("auto", "model", "precompute", "base")


@dataclass(frozen=True)
class DpoSettings:
    """`training.dpo` (used when `training.objective=dpo`). Names and defaults are TRL's
    `DPOConfig`'s, so a TRL recipe carries over."""

    beta: float = 0.1
    # sigmoid: DPO's -log sigmoid(beta * margin); ipo: the squared distance of the
    # per-token-normalised margin to 1/(2 beta); robust: sigmoid with label noise.
    loss_type: Literal["sigmoid", "ipo", "robust"] = "sigmoid"
    # The assumed fraction of flipped labels (robust only, as TRL 1.16 applies it).
    label_smoothing: float = 0.0
    # What the policy is compared with: model (a frozen copy of the starting weights,
    # laid out like the policy), precompute (the starting weights' log-probabilities
    # computed in one pass before training, so training holds one model), base (under
    # LoRA: the same model with its adapters switched off, no second model); auto: base
    # under LoRA, model otherwise.
    reference: Literal["auto", "model", "precompute", "base"] = "auto"

    def check(self) -> None:
        if not self.beta > 0:
            raise ConfigError(
                f"`training.dpo.beta` is {self.beta}; it must be positive (TRL's default is "
                "0.1; larger keeps the policy closer to the reference)."
            )
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                f"`training.dpo.label_smoothing` is {self.label_smoothing}; use a fraction of "
                "flipped labels in [0, 0.5)."
            )
        if self.label_smoothing and self.loss_type != "robust":
            raise ConfigError(
                f"`training.dpo.label_smoothing` is {self.label_smoothing} but "
                f"`training.dpo.loss_type` is {self.loss_type}, which does not use it (TRL "
                "1.16 applies it to robust): set loss_type=robust, or label_smoothing=0."
            )

    def resolved_reference(self, lora: bool) -> str:
        """`auto` as the run implies: the adapters-off base under LoRA, else a copy."""
        if self.reference == "auto":
            return "base" if lora else "model"
        return self.reference


def check_preference_run(
    settings: DpoSettings,
    *,
    lora: bool,
    init_from: str | None,
    loss_chunk_tokens: int | str,
) -> None:
    """What a DPO run refuses about the rest of the run, before any worker starts."""
    if init_from is None:
        raise ConfigError(
            "`training.objective=dpo` needs `model.init_from`: preference optimization "
            "moves a trained model (usually after supervised fine-tuning) away from its "
            "starting point; on random weights it learns nothing useful. Set model.init_from "
            "(e.g. data/06_models/consolidated after `kedro run --env sft`)."
        )
    if settings.reference == "base" and not lora:
        raise ConfigError(
            "`training.dpo.reference=base` is the model with its LoRA adapters switched off, "
            "but `model.lora` is not set: use reference=model (a frozen copy) or precompute."
        )
    if loss_chunk_tokens == 0:
        raise ConfigError(
            "`training.loss_chunk_tokens=0` scores the whole logits, but DPO's log-"
            "probabilities come from the chunked LM head: use auto (or a chunk size)."
        )


def check_objective_data(objective: str, data_format: str | None) -> None:
    """DPO trains on preference pairs, and preference pairs only with DPO (`data_format`:
    the data's TRL format where it is known; None: not known before it is read)."""
    if data_format is None or (objective == "dpo") == (data_format == "preference"):
        return
    if objective == "dpo":
        raise ConfigError(
            f"`training.objective=dpo` trains on preference pairs, but the data is "
            f"{data_format.replace('_', '/')}, not pairs: use pairs (data.source="
            "builtin_preferences, or files with chosen and rejected columns)."
        )
    raise ConfigError(
        "the data is preference pairs (chosen and rejected), which `training.objective=lm` "
        "would train as text: set training.objective=dpo, or use examples of another format."
    )
