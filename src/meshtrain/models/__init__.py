"""Model adapters: how to build each supported architecture and how it maps to Hugging Face.

The builders are loaded on first use: importing `meshtrain.models.llama.parameter_names`
(the planner does) must not pull in the modelling code.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "build_model",
    "build_model_config",
    "config_from_dict",
    "parameter_shapes",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from meshtrain.models import builder  # noqa: PLC0415

        return getattr(builder, name)
    raise AttributeError(f"module 'meshtrain.models' has no attribute {name!r}")
