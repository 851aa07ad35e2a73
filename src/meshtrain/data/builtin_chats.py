"""Question/answer conversations made offline from the documentation shipped with Python.

The fine-tuning counterpart of the builtin corpus: every help topic of `pydoc_data` and
every documented stdlib module, class and function becomes a user question ("What does
`json.dumps` do?") answered by the first paragraphs of its documentation. Questions vary
in wording, every fifth conversation asks a second question, every seventh starts with a
system prompt. Deterministic, and built in seconds with no network.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import datasets

from meshtrain.data.corpus import _definitions, _gc_paused, _stdlib_sources

MAX_ANSWER_CHARS = 1200
MIN_ANSWER_CHARS = 60
SYSTEM_PROMPT = "You are a concise assistant who answers questions about Python."
TOPIC_QUESTIONS = (
    "Explain `{name}` in Python.",
    "What does the Python documentation say about `{name}`?",
    "Tell me about `{name}` in Python.",
)
DEFINITION_QUESTIONS = {
    "module": ("What is the `{name}` module for?", "Describe the Python module `{name}`."),
    "class": ("What is the class `{name}`?", "Explain the Python class `{name}`."),
    "function": ("What does `{name}` do?", "Explain `{name}`.", "What is `{name}` for?"),
}


def short_answer(text: str) -> str:
    """The first paragraphs that fit MAX_ANSWER_CHARS, else the first one cut at a
    sentence end."""
    paragraphs = [p.strip() for p in text.strip().split("\n\n") if p.strip()]
    answer = ""
    for paragraph in paragraphs:
        joined = f"{answer}\n\n{paragraph}" if answer else paragraph
        if len(joined) > MAX_ANSWER_CHARS:
            break
        answer = joined
    if answer:
        return answer
    cut = paragraphs[0][:MAX_ANSWER_CHARS] if paragraphs else ""
    end = cut.rfind(". ")
    return cut[: end + 1] if end > 0 else ""


def _topic_pairs() -> Iterator[tuple[str, str, str]]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield "topic", key, topics[key]


def _definition_pairs() -> Iterator[tuple[str, str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_sources():
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        try:
            with _gc_paused():
                tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            continue
        for node in _definitions(tree):
            if isinstance(node, ast.Module):
                kind, name = "module", module
            else:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                name = f"{module}.{node.name}"
            if not name.split(".")[-1].startswith("_"):
                yield kind, name, ast.get_docstring(node, clean=True) or ""


def _questions() -> Iterator[tuple[str, str]]:
    """(question, answer) pairs, each documentation text at most once."""
    seen: set[str] = set()
    for number, (kind, name, text) in enumerate(_chain()):
        answer = short_answer(text)
        if len(answer) < MIN_ANSWER_CHARS or answer in seen:
            continue
        seen.add(answer)
        wordings = TOPIC_QUESTIONS if kind == "topic" else DEFINITION_QUESTIONS[kind]
        yield wordings[number % len(wordings)].format(name=name), answer


def _chain() -> Iterator[tuple[str, str, str]]:
    yield from _topic_pairs()
    yield from _definition_pairs()


def builtin_conversations() -> Iterator[list[dict[str, str]]]:
    """Conversations in a fixed order: one question, or two, or a system prompt first."""
    pairs = _questions()
    for number, (question, answer) in enumerate(pairs):
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if number % 5 == 4:
            follow = next(pairs, None)
            if follow is not None:
                turns += [
                    {"role": "user", "content": follow[0]},
                    {"role": "assistant", "content": follow[1]},
                ]
        if number % 7 == 6:
            turns.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        yield turns


def builtin_instructions(max_chars: int | None = None) -> datasets.Dataset:
    """The conversations as a `messages` column; `max_chars` caps their total text (whole
    conversations only)."""
    rows, total = [], 0
    for turns in builtin_conversations():
        size = sum(len(turn["content"]) for turn in turns)
        if max_chars is not None and total + size > max_chars:
            break
        rows.append(turns)
        total += size
    if not rows:
        raise ValueError(f"data.builtin_max_chars={max_chars} holds no conversation; raise it")
    return datasets.Dataset.from_dict({"messages": rows})
