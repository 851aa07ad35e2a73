"""The run's tokenizer: which one (`tokenizer_source`), its size, or one trained here.

`data.tokenizer`, else the `model.init_from` model's own, else a byte-level BPE trained on
the corpus. Byte-level BPE needs no unknown token (every byte is in the base alphabet) and
decodes back to the exact input text, so a small model trained from scratch can use a
vocabulary fitted to its own corpus.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import datasets
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# What the trained tokenizer is made of, declared beside `data.vocab_size` (whose check
# needs them) so that config imports nothing from data.
from meshtrain.config import BYTE_ALPHABET_SIZE, EOS_TOKEN, SPECIAL_TOKENS, DataConfig
from meshtrain.config_parsing import names_a_path
from meshtrain.data.pretrained_tokenizer import load_data_tokenizer, tokenizer_to_load

# Read with the other pretrained tokenizers' readers; importers of this module's name keep it.
from meshtrain.data.pretrained_tokenizer import load_tokenizer as load_tokenizer


class TokenizerSource(NamedTuple):
    """Where the run's tokenizer comes from (`make_tokenizer` and `tokenizer_size` both
    ask `tokenizer_source`)."""

    name: str | None
    """`data.tokenizer`, else `model.init_from` (a folder or a hub id); None: trained here."""
    of_model: bool
    """`name` is `model.init_from`: the tokenizer the model's embedding was trained with,
    read from its folder (a hub model is fetched with its weights)."""


def tokenizer_source(data: DataConfig, init_from: str | None) -> TokenizerSource:
    """`data.tokenizer`, else the `model.init_from` model's own, else one trained here."""
    if data.tokenizer:
        return TokenizerSource(data.tokenizer, of_model=False)
    return TokenizerSource(init_from or None, of_model=bool(init_from))


def tokenizer_size(data: DataConfig, init_from: str | None) -> int | None:
    """The length the run's tokenizer will have, without building it: at most
    `data.vocab_size` for one trained here (a small corpus yields fewer merges), a local
    folder's own length, None for a hub tokenizer or model (known once downloaded)."""
    source = tokenizer_source(data, init_from)
    if source.name is None:
        return data.vocab_size
    if not names_a_path(source.name):
        return None
    return len(read_tokenizer(source.name, of_model=source.of_model))


def read_tokenizer(name: str, *, of_model: bool) -> Any:
    """The tokenizer `name` holds (`of_model`: the model's folder, refused if it ships
    none); one transformers cannot read is refused naming it."""
    folder = tokenizer_to_load(None, name) if of_model else name
    return load_data_tokenizer(folder)


def train_tokenizer(
    corpus: datasets.Dataset,
    vocab_size: int,
    *,
    min_frequency: int = 2,
    batch_size: int = 1000,
) -> transformers.PreTrainedTokenizerFast:
    """Fit byte-level BPE on column ``text`` of ``corpus``, streaming it in batches.

    ``len()`` of the result is the embedding size the model needs; it can be below
    ``vocab_size`` when the corpus is too small to yield that many merges.
    """
    minimum = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS) + 1
    if vocab_size < minimum:
        raise ValueError(
            f"data.vocab_size must be at least {minimum} (256 byte tokens, "
            f"{len(SPECIAL_TOKENS)} special token(s) and one merge); got {vocab_size}"
        )
    if "text" not in corpus.column_names:
        raise ValueError(f"corpus needs a 'text' column; it has {corpus.column_names}")
    if len(corpus) == 0:
        raise ValueError("cannot train a tokenizer on an empty corpus")

    tokenizer = Tokenizer(models.BPE())
    # No prefix space: the text is reproduced byte for byte, and the first word of a document
    # gets the same ids whether it starts a block or follows an eos.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(
        _text_batches(corpus, batch_size), trainer=trainer, length=len(corpus)
    )
    trained = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        # Keep decode() an exact inverse of encode(): no space clean-up around punctuation.
        clean_up_tokenization_spaces=False,
    )
    trained.chat_template = CHATML_TEMPLATE
    return trained


# ChatML: each turn `<|im_start|>{role}\n{content}<|im_end|>\n`. An assistant turn's content
# and its end marker are what a model learns to write, so `{% generation %}` marks them
# (transformers' assistant-token mask reads the marks; meshtrain's own mask does not need
# them, see data/chat_tokens.py).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _text_batches(corpus: datasets.Dataset, batch_size: int) -> Iterator[list[str]]:
    """Stream the text column so only one batch of documents is in memory at a time."""
    for batch in corpus.select_columns(["text"]).iter(batch_size=batch_size):
        yield batch["text"]
