"""Keep a benchmark or test process offline and quiet before the libraries load.

No hub downloads (models, tokenizers, datasets), no telemetry from Kedro or
MLflow, no tokenizer thread pools fighting the ranks for cores. Values the
caller's environment already sets win.
"""

from __future__ import annotations

import os

OFFLINE_DEFAULTS = {
    "KEDRO_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def use_offline_defaults() -> None:
    """Set every `OFFLINE_DEFAULTS` variable the environment does not set already."""
    for key, value in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(key, value)
