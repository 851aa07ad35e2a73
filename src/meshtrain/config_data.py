"""`data.*`: the corpus or fine-tuning examples, the tokenizer and the packing, and the
refusals of values whose kinds are right but which cannot make a corpus or blocks, or
which the other `data.*` settings make meaningless."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshtrain.config_parsing import ConfigError, check_ranges
from meshtrain.config_ranges import DATA_RANGES

# The byte-level BPE tokenizer trained when `data.tokenizer` is null (data/tokenizer.py
# builds it from these): a token per byte and the special tokens, before any merge.
BYTE_ALPHABET_SIZE = 256
EOS_TOKEN = "<|endoftext|>"
"""Separates documents when packing; also serves as bos and pad."""
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
"""ChatML's turn markers: the trained tokenizer's chat template opens and ends turns with
them, so a model pretrained here can be fine-tuned on conversations."""
SPECIAL_TOKENS = (EOS_TOKEN, *CHAT_TOKENS)

# Sources read as a text corpus whatever `data.format` says (data/corpus.py).
TEXT_SOURCES = ("builtin", "text_files")
# The tokens that carry the loss in each of TRL's formats (`data.loss_on: auto`); `all`
# fits every format.
LOSS_ON_BY_FORMAT = {
    "text": "all",
    "prompt_completion": "completion",
    "conversational": "assistant",
    "preference": "completion",
}


@dataclass(frozen=True)
class DataConfig:
    """Corpus or fine-tuning examples, tokenizer and packing (`data.*`)."""

    # builtin / text_files / hub: a text corpus. files: JSON, JSONL, Parquet or CSV files
    # (`data_files`); catalog: the Kedro dataset `raw_examples`; builtin_instructions:
    # question/answer conversations made offline from Python's documentation;
    # builtin_preferences: preference pairs made from them (`data/preference.py`).
    source: Literal[
        "builtin",
        "text_files",
        "hub",
        "files",
        "catalog",
        "builtin_instructions",
        "builtin_preferences",
    ] = "builtin"
    text_files: list[str] | None = None
    data_files: list[str] | None = None
    hub_dataset: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"
    text_column: str = "text"
    # The dataset's own column names for TRL's, e.g. {messages: conversations}.
    columns: dict[str, str] | None = None
    # TRL's formats; auto: from the columns (chosen + rejected, messages, prompt +
    # completion, text). preference: DPO's pairs, with or without a prompt column.
    format: Literal["auto", "text", "prompt_completion", "conversational", "preference"] = "auto"
    # Which tokens carry the loss; auto: completion for prompt/completion data, assistant
    # for conversations, all for text.
    loss_on: Literal["auto", "all", "completion", "assistant"] = "auto"
    # stream: documents concatenated and cut into blocks (pretraining); bfd: whole examples
    # best-fit into blocks, positions restarting and attention kept inside each example;
    # auto: stream for a text corpus, bfd for fine-tuning examples.
    packing: Literal["auto", "stream", "bfd"] = "auto"
    # An example longer than a block (bfd): drop it (counted), truncate it, or off (refuse).
    truncation: Literal["drop", "truncate", "off"] = "drop"
    # A Jinja chat template file replacing the tokenizer's own.
    chat_template: str | None = None
    builtin_max_chars: int | None = None
    tokenizer: str | None = None
    vocab_size: int = 4096
    block_size: int = 128
    validation_fraction: float = 0.05
    seed: int = 1234
    num_proc: int | None = 2

    @property
    def reads_text_corpus(self) -> bool:
        """Whether `data.*` names a text corpus (`data/corpus.py`), before anything is read;
        examples (any other source, or the Hub with data.format other than text) may still
        turn out to be text once their columns are seen."""
        return self.source in TEXT_SOURCES or (self.source == "hub" and self.format == "text")

    @property
    def known_format(self) -> str | None:
        """The TRL format the data will have, where the settings alone tell (a text corpus
        source, the builtin conversations, or an explicit `data.format`); None where only
        the columns will."""
        if self.source in TEXT_SOURCES:
            return "text"
        if self.source == "builtin_instructions":
            return "conversational"
        if self.source == "builtin_preferences":
            return "preference"
        return None if self.format == "auto" else self.format

    def check(self) -> None:
        """Refuse the values whose kinds are right but which cannot make a corpus or blocks,
        before any data is read or written."""
        _check_sources(self)
        check_ranges(self, DATA_RANGES)
        if not self.text_column.strip():
            raise ConfigError("`data.text_column` is empty; name the corpus column, e.g. text.")
        minimum = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS) + 1
        if self.tokenizer is None and self.vocab_size < minimum:
            raise ConfigError(
                f"`data.vocab_size` is {self.vocab_size}; the byte-level tokenizer trained here "
                f"needs at least {minimum} (256 byte tokens, {len(SPECIAL_TOKENS)} special, one "
                "merge), e.g. 4096."
            )
        _check_against_the_format(self)


def _check_sources(data: DataConfig) -> None:
    """A source names what it reads."""
    if data.source == "text_files" and not data.text_files:
        raise ConfigError(
            "`data.source=text_files` needs `data.text_files`, the paths or glob patterns of "
            "the text files, e.g. data.text_files=/corpus/*.txt."
        )
    if data.source == "hub" and not data.hub_dataset:
        raise ConfigError(
            "`data.source=hub` needs `data.hub_dataset`, a Hugging Face dataset id, e.g. "
            "data.hub_dataset=Salesforce/wikitext with data.hub_config=wikitext-103-raw-v1."
        )
    if data.source == "files" and not data.data_files:
        raise ConfigError(
            "`data.source=files` needs `data.data_files`, the paths or glob patterns of JSON, "
            "JSONL, Parquet or CSV files, e.g. data.data_files=data/01_raw/chats/*.jsonl."
        )
    if data.packing == "stream" and data.source == "builtin_instructions":
        raise ConfigError(
            "`data.packing=stream` concatenates text; the builtin instructions are "
            "conversations: use data.packing=bfd (or auto)."
        )


def _described(data: DataConfig) -> str:
    """The settings that fix the data's format, as a refusal names them."""
    if data.source in TEXT_SOURCES:
        return f"`data.source={data.source}` is plain text (data.format text: no turns, no prompts)"
    if data.source == "builtin_instructions":
        return "`data.source=builtin_instructions` is conversations"
    if data.source == "builtin_preferences":
        return "`data.source=builtin_preferences` is preference pairs"
    return f"`data.format={data.format}` says the data is {data.format.replace('_', '/')}"


def _check_against_the_format(data: DataConfig) -> None:
    """Refuse a `data.*` value the data's format (known before it is read) makes
    meaningless: it would be ignored, or refused only after the corpus was built."""
    fmt = data.known_format
    if fmt is None:
        return
    if data.source in TEXT_SOURCES and data.format not in ("auto", "text"):
        raise ConfigError(
            f"`data.format={data.format}` needs examples with those columns, but "
            f"{_described(data)}: use data.format=auto (or text), or a source of examples "
            "(data.source=files, hub, catalog or builtin_instructions)."
        )
    if data.source == "builtin_instructions" and data.format not in ("auto", "conversational"):
        raise ConfigError(
            f"`data.format={data.format}` does not fit `data.source=builtin_instructions`, "
            "which is conversations: use data.format=auto (or conversational)."
        )
    if data.loss_on not in ("auto", "all", LOSS_ON_BY_FORMAT[fmt]):
        needs = next(f for f, on in LOSS_ON_BY_FORMAT.items() if on == data.loss_on)
        sources = "data.source=builtin_instructions, or " if needs == "conversational" else ""
        raise ConfigError(
            f"`data.loss_on={data.loss_on}` trains only the {data.loss_on} tokens of "
            f"{needs.replace('_', '/')} examples, but {_described(data)}: every token would "
            f"be trained. Use data.loss_on=auto or {LOSS_ON_BY_FORMAT[fmt]} for this data, or "
            f"{needs.replace('_', '/')} data: {sources}data.source=files with "
            f"data.format={needs}."
        )
    if data.packing == "stream" and fmt != "text":
        raise ConfigError(
            f"`data.packing=stream` concatenates text documents, but {_described(data)}: "
            "use data.packing=bfd (or auto)."
        )
    streams = data.packing == "stream" or (data.packing == "auto" and fmt == "text")
    if streams and data.truncation != "drop":
        raise ConfigError(
            f"`data.truncation={data.truncation}` applies to whole examples packed with bfd, "
            f"but `data.packing={data.packing}` streams this text into blocks (nothing is "
            "longer than a block): leave data.truncation at drop, or use data.packing=bfd."
        )
    if data.columns and data.source in TEXT_SOURCES:
        raise ConfigError(
            f"`data.columns` maps the columns of examples, but {_described(data)}, read "
            "without columns: remove data.columns (data.text_column names a hub corpus's "
            "column)."
        )


def check_data(data: DataConfig) -> None:
    """`data.check()`, under the name the data nodes call."""
    data.check()
