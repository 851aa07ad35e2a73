"""One example as token ids and the mask of the tokens the run trains on.

TRL's formats and its token conventions: `text` (the text and an eos), prompt/completion
(strings, or message lists through the chat template; the completion is what follows the
longest common prefix of the prompt's and the whole example's tokens) and conversational
`messages`. For conversations the assistant turns are found without the template's
`{% generation %}` marks, so templates without them (Qwen2's, Llama 3's) work: each
assistant turn is where rendering the conversation up to it with the generation prompt
stops and rendering it with the turn goes on, up to and including the first special
token the template writes after the content (its end of turn, e.g. `<|im_end|>`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import jinja2

from meshtrain.config_parsing import ConfigError


class ChatTemplateError(ConfigError):
    """The chat template is missing, does not render, or renders turns inconsistently."""


def resolve_chat_template(tokenizer: Any, template_file: str | None) -> None:
    """`data.chat_template`'s file replaces the tokenizer's own template."""
    if not template_file:
        return
    path = Path(template_file)
    if not path.is_file():
        raise ChatTemplateError(
            f"`data.chat_template` {template_file!r} is not a file: name a Jinja template "
            "file, or leave it null to use the tokenizer's own template."
        )
    tokenizer.chat_template = path.read_text()


def require_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            "the examples are conversations but the tokenizer (data.tokenizer, or "
            "model.init_from's) has no chat template: set data.chat_template to a Jinja "
            "template file, or use a tokenizer that ships one."
        )


def render_chat(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except (jinja2.TemplateError, TypeError, ValueError) as error:
        raise ChatTemplateError(
            f"the chat template does not render this conversation ({error}): fix it, or set "
            "data.chat_template to another template file."
        ) from None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def assistant_spans(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns, each
    through the end-of-turn token the template writes after the content."""
    whole = render_chat(tokenizer, messages)
    specials = [t for t in tokenizer.all_special_tokens if t] + [
        t.content for t in tokenizer.added_tokens_decoder.values() if t.special
    ]
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = render_chat(tokenizer, messages[:k], generation_prompt=True)
        upto = render_chat(tokenizer, messages[: k + 1])
        if not (whole.startswith(head) and whole.startswith(upto) and len(head) <= len(upto)):
            raise ChatTemplateError(
                "the chat template renders a conversation's first turns differently once "
                "later turns follow, so its assistant turns cannot be found: use a template "
                "whose renderings of a conversation's beginnings are prefixes of the whole "
                "(data.chat_template)."
            )
        turn = whole[len(head) : len(upto)]
        ends = [turn.find(t) + len(t) for t in specials if t in turn]
        spans.append((len(head), len(head) + (min(ends) if ends else len(turn))))
    return whole, spans


def _conversation(tokenizer: Any, messages: list[dict], loss_on: str) -> tuple[list, list]:
    whole, spans = assistant_spans(tokenizer, messages)
    encoded = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    if loss_on == "all":
        return ids, [1] * len(ids)
    trained = [int(any(a <= start < b for a, b in spans)) for start, _ in encoded["offset_mapping"]]
    return ids, trained


def _prompt_completion(tokenizer: Any, example: dict, loss_on: str) -> tuple[list, list]:
    prompt, completion = example["prompt"], example["completion"]
    if isinstance(prompt, list):
        head = tokenizer(
            render_chat(tokenizer, prompt, generation_prompt=True), add_special_tokens=False
        )["input_ids"]
        ids = tokenizer(render_chat(tokenizer, prompt + completion), add_special_tokens=False)[
            "input_ids"
        ]
    else:
        eos = tokenizer.eos_token
        if not completion.endswith(eos):
            completion += eos
        head = tokenizer(prompt)["input_ids"]
        ids = tokenizer(prompt + completion)["input_ids"]
    if loss_on == "all":
        return ids, [1] * len(ids)
    start = common_prefix(head, ids)
    return ids, [0] * start + [1] * (len(ids) - start)


def tokenize_example(example: dict, tokenizer: Any, fmt: str, loss_on: str) -> tuple[list, list]:
    """Token ids and the 0/1 mask of trained tokens (token 0 never: nothing precedes it)."""
    if fmt == "conversational":
        ids, trained = _conversation(tokenizer, example["messages"], loss_on)
    elif fmt == "prompt_completion":
        ids, trained = _prompt_completion(tokenizer, example, loss_on)
    else:
        text, eos = example["text"], tokenizer.eos_token
        ids = tokenizer(text if text.endswith(eos) else text + eos)["input_ids"]
        trained = [1] * len(ids)
    if trained:
        trained[0] = 0
    return ids, trained


def tokenize_examples(
    ds: datasets.Dataset, tokenizer: Any, *, fmt: str, loss_on: str, num_proc: int | None = None
) -> tuple[datasets.Dataset, int]:
    """`input_ids` and `trained` per example, those with nothing to train dropped (their
    number returned). The same for any `num_proc`."""
    if fmt == "conversational" or (
        fmt == "prompt_completion" and len(ds) and isinstance(ds[0]["prompt"], list)
    ):
        require_chat_template(tokenizer)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        rows = [
            dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)
        ]
        pairs = [tokenize_example(row, tokenizer, fmt, loss_on) for row in rows]
        return {"input_ids": [p[0] for p in pairs], "trained": [p[1] for p in pairs]}

    tokens = ds.map(
        encode,
        batched=True,
        num_proc=num_proc if num_proc and num_proc > 1 else None,
        remove_columns=ds.column_names,
        features=datasets.Features(
            {
                "input_ids": datasets.List(datasets.Value("int32")),
                "trained": datasets.List(datasets.Value("int8")),
            }
        ),
        desc="Tokenize examples",
    )
    kept = tokens.filter(lambda batch: [any(m) for m in batch["trained"]], batched=True)
    return kept, len(tokens) - len(kept)
