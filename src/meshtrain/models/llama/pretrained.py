"""A Hugging Face checkpoint folder for `model.init_from`: where each tensor is, and whether
the weights are those of the folder's own config. Torch-free (headers only), so the
planner refuses a bad folder before any worker starts, naming the tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from meshtrain.checkpoint import files
from meshtrain.checkpoint.expert_layout import stored_shapes
from meshtrain.checkpoint.remote import is_url, mirror_folder
from meshtrain.checkpoint.safetensors_format import folder_weight_files, read_safetensors_header
from meshtrain.config import Refused
from meshtrain.config_parsing import names_a_path
from meshtrain.models.llama.parameter_names import llama_family_shapes
from meshtrain.models.moe_config import num_experts

# Where a `model.init_from` URL's folder is copied, once, and kept up to date.
REMOTE_CACHE = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "meshtrain"


class PretrainedError(Refused, ValueError):
    """`model.init_from` names a folder meshtrain cannot start from; the message says why."""


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or the index's map)."""
    located = folder_weight_files(folder)
    if located is not None:
        return located
    raise PretrainedError(
        f"`model.init_from` {str(folder)!r} holds neither {files.HF_WEIGHTS} nor "
        f"{files.HF_WEIGHTS_INDEX}: meshtrain starts from Hugging Face safetensors "
        "weights (save_pretrained writes them)."
    )


def check_pretrained(folder: str | Path, config: Any) -> None:
    """Refuse a folder whose tensors are not exactly those of its config: every name the
    model has, of the config's shape (the tied LM head stored once), and nothing else; a
    mixture of experts' experts one tensor each (`checkpoint.expert_layout`)."""
    expected = stored_shapes(config.model_type, num_experts(config), llama_family_shapes(config))
    stored = {}
    for path in sorted(set(weight_files(folder).values())):
        if not path.is_file():
            raise PretrainedError(
                f"`model.init_from` {str(folder)!r}: its index names {path.name}, which is "
                "not there: the download or copy is incomplete."
            )
        for name, tensor in read_safetensors_header(path).items():
            stored[name] = tuple(tensor.shape)
    if getattr(config, "tie_word_embeddings", False):
        stored.pop("lm_head.weight", None)  # some writers keep the tied copy; it is the same
    for name, shape in expected.items():
        if name not in stored:
            raise PretrainedError(
                f"`model.init_from` {str(folder)!r} has no tensor {name}, which its config "
                f"({config.model_type}, {config.num_hidden_layers} layers) needs: it is not a "
                "complete checkpoint of that config."
            )
        if stored[name] != shape:
            raise PretrainedError(
                f"`model.init_from` {str(folder)!r}: tensor {name} is {list(stored[name])} but "
                f"its config.json makes it {list(shape)}: the weights and the config disagree."
            )
    extra = sorted(set(stored) - set(expected))
    if extra:
        raise PretrainedError(
            f"`model.init_from` {str(folder)!r} holds tensors a {config.model_type} model of "
            f"its config does not have, e.g. {extra[0]}: it is not a Llama-family checkpoint "
            "meshtrain can start from."
        )


def check_folder(folder: str | Path) -> None:
    """Refuse a local folder without a readable `config.json` naming a model type, or
    without safetensors weights, before transformers reads it ("Unrecognized model")."""
    config = Path(folder) / "config.json"
    if not config.is_file():
        present = ", ".join(sorted(path.name for path in Path(folder).iterdir())[:6]) or "nothing"
        raise PretrainedError(
            f"`model.init_from` {str(folder)!r} has no config.json (it holds {present}): "
            "give the folder save_pretrained wrote, with config.json and *.safetensors."
        )
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError) as error:
        raise PretrainedError(
            f"`model.init_from` {str(folder)!r}: its config.json is not a JSON object "
            f"({error}); re-save it with save_pretrained."
        ) from None
    if not model_type:
        raise PretrainedError(
            f"`model.init_from` {str(folder)!r}: its config.json has no model_type; "
            "meshtrain starts from llama, qwen2, qwen3, mistral, qwen3_moe or mixtral "
            "checkpoints."
        )
    weight_files(folder)


def resolve_init_from(init_from: str) -> str:
    """A local folder as it is; a hub id downloaded once (weights, config, tokenizer) into
    the Hugging Face cache, a URL (`s3://`, `gs://`) into meshtrain's, whose folder is
    then used the same way."""
    if is_url(init_from):
        folder = str(mirror_folder(init_from, REMOTE_CACHE))
        check_folder(folder)
        return folder
    if Path(init_from).is_dir():
        check_folder(init_from)
        return init_from
    if names_a_path(init_from):
        raise PretrainedError(
            f"`model.init_from` {init_from!r} is not a folder: pass a local folder written by "
            "save_pretrained (config.json and *.safetensors), or a hub id such as "
            "Qwen/Qwen2.5-0.5B."
        )
    from huggingface_hub import snapshot_download  # noqa: PLC0415

    try:
        return snapshot_download(
            init_from, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]
        )
    except Exception as error:  # offline, unknown id, no access: say which and why
        raise PretrainedError(
            f"`model.init_from` {init_from!r} is not a local folder and could not be fetched "
            f"from the Hugging Face hub ({type(error).__name__}: {error}). Pass a local folder "
            "written by save_pretrained, or run where the hub is reachable (HF_HUB_OFFLINE unset)."
        ) from None
