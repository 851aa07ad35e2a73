"""The consolidated model as an MLflow transformers model of the run, registered by name.

Logged from its folder (MLflow's memory-efficient logging: the weights are copied as
files, never loaded), task text-generation, with the tokenizer beside it. Metrics
logged into the run afterwards at step 0 (the evaluation's) are linked to the logged
model by MLflow 3. Nothing here imports Kedro.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshtrain.checkpoint.consolidate.lora import adapter_base, is_adapter_folder
from meshtrain.offline import disable_telemetry

disable_telemetry()  # before mlflow is imported

import mlflow  # noqa: E402

logger = logging.getLogger(__name__)

# The logged model's name in the run (its artifacts go under it).
MODEL_NAME = "model"


@contextlib.contextmanager
def _pipeline_classes_resolved() -> Iterator[None]:
    """MLflow 3.17 reads `check_task(task)[1]["impl"].__name__` when it logs from a folder;
    transformers 5 gives `impl` as a dotted string. Hand MLflow the class for the call."""
    from transformers import pipelines

    real = pipelines.check_task

    def check_task(task: str):
        name, meta, other = real(task)
        impl = meta.get("impl")
        if isinstance(impl, str):
            module, _, cls = impl.rpartition(".")
            meta = {**meta, "impl": getattr(importlib.import_module(module), cls)}
        return name, meta, other

    pipelines.check_task = check_task
    try:
        yield
    finally:
        pipelines.check_task = real


def _requirements() -> list[str]:
    """What loading the model needs, given outright: MLflow would otherwise infer them by
    loading the model in a subprocess, the memory and minutes this logging avoids."""
    import torch
    import transformers

    return [
        f"torch=={torch.__version__.split('+')[0]}",
        f"transformers=={transformers.__version__}",
        "safetensors",
        "tokenizers",
    ]


def _signature():
    """Text in, text out, and the generation knobs a caller may pass to `predict(params=)`
    (MLflow ignores params a signature does not declare)."""
    from mlflow.models import infer_signature

    params = {
        "max_new_tokens": 40,
        "do_sample": False,
        "temperature": 1.0,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
    }
    return infer_signature(["The"], ["The model"], params=params)


def _peft_model(folder: Path) -> dict[str, Any]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(adapter_base(folder))
    return {
        "model": PeftModel.from_pretrained(base, str(folder)),
        "tokenizer": AutoTokenizer.from_pretrained(str(folder)),
    }


def log_consolidated_model(
    model_dir: str | Path,
    *,
    registered_model_name: str | None,
    tags: dict[str, str],
) -> Any | None:
    """Log `model_dir` (a Hugging Face folder with its tokenizer) to the active run and,
    when `registered_model_name` is set, register it as a new version of that name
    (MLflow copies the model's `tags`, the layout, onto the version). Returns MLflow's
    ModelInfo, or None outside a run."""
    if mlflow.active_run() is None:
        return None
    model: Any = str(model_dir)
    if is_adapter_folder(model_dir):
        # A LoRA run's adapter folder: MLflow's transformers flavour stores a PEFT model
        # as its adapter and the base it applies to (base_model_name_or_path).
        model = _peft_model(Path(model_dir))
        tags = {**tags, "meshtrain.lora_base": str(adapter_base(model_dir))}
    with _pipeline_classes_resolved():
        info = mlflow.transformers.log_model(
            transformers_model=model,
            name=MODEL_NAME,
            task="text-generation",
            pip_requirements=_requirements(),
            signature=_signature(),
            registered_model_name=registered_model_name or None,
            tags=tags,
        )
    logger.info(
        "MLflow: logged the model as %s%s",
        info.model_uri,
        f" (registered {registered_model_name} v{info.registered_model_version})"
        if registered_model_name
        else "",
    )
    return info
