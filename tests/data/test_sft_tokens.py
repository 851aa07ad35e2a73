"""The tokens meshtrain trains on are TRL's, token for token.

The oracle is TRL 1.16's own dataset preparation (`SFTTrainer._prepare_dataset`, run on
CPU with no model): its labels are the tokens it trains. meshtrain finds assistant turns
without the template's `{% generation %}` marks; TRL reads the marks (transformers'
assistant-token mask). Over 200+ conversations (the builtin set and multi-turn ones with
a system prompt), prompt/completion rows (strings and message lists) and text rows.
"""

from __future__ import annotations

import types

import datasets
import pytest

from meshtrain.data.builtin import builtin_instructions
from meshtrain.data.chat_tokens import ChatTemplateError, tokenize_example
from meshtrain.data.corpus import load_corpus
from meshtrain.data.tokenizer import train_tokenizer

# Qwen2's template as it ships (ChatML, a default system prompt, no generation marks).
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(load_corpus("builtin", builtin_max_chars=200_000), 1000)


def _multi_turn(count: int) -> list[list[dict[str, str]]]:
    """Conversations of 2-4 exchanges after a system prompt, answers of varied shapes."""
    chats = []
    for n in range(count):
        turns = [{"role": "system", "content": f"You answer briefly ({n})."}]
        for k in range(2 + n % 3):
            turns.append({"role": "user", "content": f"Question {k} of {n}: what is {n * k}?"})
            answer = f"It is {n * k}." + (" Indeed,\n\nsee `math`." if k % 2 else "")
            turns.append({"role": "assistant", "content": answer})
        chats.append(turns)
    return chats


def trl_labels(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """TRL's ids and trained mask (labels that are not -100) for each row."""
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir="unused",
        assistant_only_loss="messages" in rows[0],
        completion_only_loss=True,
        max_length=None,
        use_cpu=True,
        bf16=False,
        report_to=[],
    )
    trainer = types.SimpleNamespace(
        _tokenizer=tokenizer, completion_only_loss=True, chat_template=None
    )
    prepared = SFTTrainer._prepare_dataset(
        trainer, datasets.Dataset.from_list(rows), tokenizer, args, False, None, "train"
    )
    return [(row["input_ids"], [int(label != -100) for label in row["labels"]]) for row in prepared]


def assert_same_tokens(tokenizer, rows: list[dict], fmt: str, loss_on: str) -> None:
    expected = trl_labels(tokenizer, rows)
    assert len(expected) == len(rows)
    for number, (row, (ids, mask)) in enumerate(zip(rows, expected, strict=True)):
        got_ids, trained = tokenize_example(row, tokenizer, fmt, loss_on)
        assert got_ids == ids, number
        # Token 0 is never a target (nothing precedes it); TRL labels it and HF's shift
        # drops it.
        assert trained[1:] == mask[1:] and trained[0] == 0, (number, row)


def test_conversations_train_the_tokens_trl_trains(tokenizer):
    chats = builtin_instructions()["messages"][:150] + _multi_turn(60)
    assert len(chats) >= 200
    assert_same_tokens(
        tokenizer, [{"messages": chat} for chat in chats], "conversational", "assistant"
    )


def test_prompt_completion_and_text_train_the_tokens_trl_trains(tokenizer):
    strings = [{"prompt": f"Q{i}: what is {i}?", "completion": f" It is {i}."} for i in range(30)]
    assert_same_tokens(tokenizer, strings, "prompt_completion", "completion")
    chats = _multi_turn(30)
    messages = [{"prompt": chat[:-1], "completion": chat[-1:]} for chat in chats]
    assert_same_tokens(tokenizer, messages, "prompt_completion", "completion")
    texts = [{"text": f"Document {i} about `json.dumps`."} for i in range(20)]
    assert_same_tokens(tokenizer, texts, "text", "all")


def test_a_template_without_generation_marks_trains_the_same_answers(tokenizer):
    chats = _multi_turn(20) + builtin_instructions()["messages"][:40]
    marked, plain = tokenizer, _with_template(tokenizer, QWEN2_TEMPLATE)
    for chat in chats:
        answers = []
        for tok in (marked, plain):
            ids, trained = tokenize_example({"messages": chat}, tok, "conversational", "assistant")
            answers.append(tok.decode([i for i, t in zip(ids, trained, strict=True) if t]))
        assert answers[0] == answers[1]
        wanted = "".join(m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant")
        assert answers[0] == wanted


def _with_template(tokenizer, template: str):
    import copy

    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def test_a_template_that_does_not_render_is_refused(tokenizer):
    broken = _with_template(tokenizer, "{% for m in messages %}{{ m['role'] }")
    with pytest.raises(ChatTemplateError, match="does not render"):
        tokenize_example(
            {"messages": [{"role": "user", "content": "hi"}]}, broken, "conversational", "assistant"
        )
