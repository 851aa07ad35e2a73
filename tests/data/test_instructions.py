"""The builtin instruction set: offline, deterministic conversations in TRL's
conversational format, answers cut at paragraph or sentence ends, a cap on total text."""

from __future__ import annotations

import pytest

from meshtrain.data.builtin import (
    MAX_ANSWER_CHARS,
    SYSTEM_PROMPT,
    builtin_instructions,
    short_answer,
)
from meshtrain.data.example_sources import check_examples, load_examples


@pytest.fixture(scope="module")
def chats() -> list[list[dict[str, str]]]:
    return builtin_instructions()["messages"]


def test_a_few_thousand_well_formed_conversations(chats):
    assert 2000 <= len(chats) <= 20_000
    for chat in chats:
        turns = chat[1:] if chat[0]["role"] == "system" else chat
        assert [t["role"] for t in turns] == ["user", "assistant"] * (len(turns) // 2)
        assert all(t["content"].strip() for t in chat)
    answers = [t["content"] for chat in chats for t in chat if t["role"] == "assistant"]
    assert max(map(len, answers)) <= MAX_ANSWER_CHARS
    assert len(set(answers)) == len(answers)  # each documentation text once


def test_some_are_multi_turn_some_have_a_system_prompt_and_questions_vary(chats):
    two = sum(len([t for t in chat if t["role"] == "assistant"]) == 2 for chat in chats)
    system = sum(chat[0] == {"role": "system", "content": SYSTEM_PROMPT} for chat in chats)
    assert 0.1 < two / len(chats) < 0.5 and 0.05 < system / len(chats) < 0.3
    questions = [t["content"] for chat in chats for t in chat if t["role"] == "user"]
    assert len({q.split("`")[0] for q in questions}) >= 5  # wordings vary
    assert any(q.startswith("Explain `") and "in Python" in q for q in questions)  # topics
    assert sum("`json.dumps`" in q for q in questions) == 1  # stdlib docstrings


def test_the_set_is_deterministic_and_the_cap_keeps_whole_conversations(chats):
    cap = 40_000
    capped = builtin_instructions(cap)["messages"]
    assert capped == chats[: len(capped)]
    size = [sum(len(t["content"]) for t in chat) for chat in chats]
    assert sum(size[: len(capped)]) <= cap < sum(size[: len(capped) + 1])
    with pytest.raises(ValueError, match="data.builtin_max_chars=10 "):
        builtin_instructions(10)


def test_answers_end_at_a_paragraph_or_a_sentence():
    paragraphs = [f"Paragraph {n} says one thing. " * 8 for n in range(10)]
    answer = short_answer("\n\n".join(p.strip() for p in paragraphs))
    assert answer.endswith(".") and len(answer) <= MAX_ANSWER_CHARS
    assert answer.split("\n\n") == [p.strip() for p in paragraphs[: len(answer.split("\n\n"))]]
    long_one = "A sentence that goes on. " * 100
    cut = short_answer(long_one)
    assert cut.endswith("goes on.") and MAX_ANSWER_CHARS - 30 < len(cut) <= MAX_ANSWER_CHARS


def test_the_builtin_source_loads_and_passes_the_checks():
    ds = load_examples("builtin_instructions", builtin_max_chars=20_000)
    checked, skipped = check_examples(ds, "conversational")
    assert skipped == 0 and checked.column_names == ["messages"] and len(checked) == len(ds)
