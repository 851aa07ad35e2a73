"""Pretrained tokenizers: reading one, and whether it fits the model it feeds.

With `model.init_from` the pretrained folder defines the model, and its tokenizer (the
vocabulary the embedding was trained on, its special tokens, its chat template) comes
with it unless `data.tokenizer` names another. Another one is refused when it cannot be
the model's: more tokens than the embedding has rows, or a different vocabulary of any
size (the model would be fine-tuned through ids it has never seen, silently). The check
reads tokenizer files only, so it runs before the data pipeline does any work.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtrain.config_parsing import ConfigError, names_a_path

if TYPE_CHECKING:
    import transformers

# Any of these makes a folder a tokenizer folder for AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenizerMismatch(ConfigError):
    """The tokenizer named for the data cannot feed the pretrained model."""


def ships_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_to_load(data_tokenizer: str | None, init_from: str | None) -> str | None:
    """`data.tokenizer`, else the `model.init_from` folder's (a local folder: a hub id is
    resolved by the caller); None: train one here."""
    if data_tokenizer:
        return data_tokenizer
    if init_from:
        folder = init_from
        if not ships_tokenizer(folder):
            raise TokenizerMismatch(
                f"`model.init_from` {init_from!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)}"
                "): set data.tokenizer to the tokenizer the model was trained with."
            )
        return folder
    return None


def check_tokenizer_fits(data_tokenizer: str | None, init_from: str | None) -> None:
    """Refuse a `data.tokenizer` that is not the local `model.init_from` folder's own, in
    one sentence. Hub ids are checked once downloaded (the planner compares sizes)."""
    if not init_from or not Path(init_from).is_dir():
        return
    if not data_tokenizer:
        tokenizer_to_load(None, init_from)  # refuses a folder that ships none
        return
    if Path(data_tokenizer).resolve() == Path(init_from).resolve():
        return
    theirs = load_tokenizer(data_tokenizer)
    rows = json.loads((Path(init_from) / "config.json").read_text()).get("vocab_size")
    if rows is not None and len(theirs) > rows:
        raise TokenizerMismatch(
            f"`data.tokenizer` {data_tokenizer!r} has {len(theirs)} tokens but the "
            f"embedding of model.init_from {init_from!r} has {rows} rows: leave "
            "data.tokenizer null to use the folder's own tokenizer."
        )
    if ships_tokenizer(init_from):
        own = load_tokenizer(init_from).get_vocab()
        other = theirs.get_vocab()
        differ = sum(own.get(token) != index for token, index in other.items())
        differ += len(own.keys() - other.keys())
        if differ:
            raise TokenizerMismatch(
                f"`data.tokenizer` {data_tokenizer!r} is not the tokenizer of model.init_from "
                f"{init_from!r} ({differ} of {len(own)} tokens differ or are missing): leave "
                "data.tokenizer null to use the folder's own tokenizer."
            )


# A Hugging Face hub id: a name, or an owner and a name.
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def check_tokenizer_name(data_tokenizer: str | None) -> None:
    """Refuse a `data.tokenizer` that is neither a tokenizer folder nor a hub id, before
    anything is read (huggingface_hub's own error is "Repo id must be in the form ...")."""
    if not data_tokenizer:
        return
    path = Path(data_tokenizer).expanduser()
    if path.is_dir():
        if not ships_tokenizer(path):
            raise TokenizerMismatch(
                f"`data.tokenizer` {data_tokenizer!r} is a folder without a tokenizer "
                f"({' or '.join(TOKENIZER_FILES)}): name the folder save_pretrained wrote "
                "the tokenizer to, or null to train one here."
            )
        return
    if names_a_path(data_tokenizer):
        raise TokenizerMismatch(
            f"`data.tokenizer` {data_tokenizer!r} is not a folder: name a tokenizer folder "
            "(save_pretrained's), a hub id such as Qwen/Qwen2.5-0.5B, or null to train one here."
        )
    if not _HUB_ID.fullmatch(data_tokenizer):
        raise TokenizerMismatch(
            f"`data.tokenizer` {data_tokenizer!r} is neither a folder nor a hub id (owner/name, "
            "e.g. Qwen/Qwen2.5-0.5B): name one, or null to train a tokenizer here."
        )


def load_data_tokenizer(name: str) -> Any:
    """The tokenizer `data.tokenizer` (or model.init_from's folder) names; a folder or hub
    id transformers cannot read is refused naming it, with transformers' reason."""
    try:
        return load_tokenizer(name)
    except (OSError, ValueError) as error:
        reason = " ".join(str(error).split())[:240]
        raise TokenizerMismatch(
            f"`data.tokenizer` {name!r} cannot be read as a tokenizer ({reason}): name a "
            "tokenizer folder or a hub id reachable from here."
        ) from None


def load_tokenizer(name_or_path: str) -> transformers.PreTrainedTokenizerBase:
    """Load a saved tokenizer folder or a Hub id; packing needs it to have an eos token."""
    # transformers takes seconds to import; the checks above (preflight's) need none of it.
    import transformers  # noqa: PLC0415

    tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"tokenizer {name_or_path!r} has no eos token; packing needs one to separate documents"
        )
    return tokenizer
