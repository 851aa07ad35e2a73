"""Load the items of meshtrain's own lm-evaluation-harness tasks from the JSONL beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).parent


def load_docs(**_: Any) -> datasets.DatasetDict:
    """The test split of `meshtrain_python_basics`, read from this folder (never the hub)."""
    path = HERE / "meshtrain_python_basics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
