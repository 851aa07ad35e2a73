"""Train a byte-level BPE tokenizer on the corpus, or load a pretrained one.

Byte-level BPE needs no unknown token (every byte is in the base alphabet) and decodes back to
the exact input text, so a small model trained from scratch can use a vocabulary fitted to its
own corpus.
"""

from __future__ import annotations

from collections.abc import Iterator

import datasets
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# What the trained tokenizer is made of, declared beside `data.vocab_size` (whose check
# needs them) so that config imports nothing from data.
from meshtrain.config import BYTE_ALPHABET_SIZE, EOS_TOKEN, SPECIAL_TOKENS


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


def load_tokenizer(name_or_path: str) -> transformers.PreTrainedTokenizerBase:
    """Load a saved tokenizer folder or a Hub id; packing needs it to have an eos token."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"tokenizer {name_or_path!r} has no eos token; packing needs one to separate documents"
        )
    return tokenizer


def _text_batches(corpus: datasets.Dataset, batch_size: int) -> Iterator[list[str]]:
    """Stream the text column so only one batch of documents is in memory at a time."""
    for batch in corpus.select_columns(["text"]).iter(batch_size=batch_size):
        yield batch["text"]
