"""Model adapters: how to build each supported architecture and how it maps to Hugging Face."""

from meshtrain.models.builder import (
    SUPPORTED_ARCHITECTURES,
    build_model,
    build_model_config,
    config_from_dict,
    parameter_shapes,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "build_model",
    "build_model_config",
    "config_from_dict",
    "parameter_shapes",
]
