"""The builtin sources, made offline from the documentation that ships with Python.

`data.source=builtin`: a small real-English text corpus, the `pydoc_data` help topics and
the stdlib's docstrings. `data.source=builtin_instructions`: question/answer conversations
made from the same documentation ("What does `json.dumps` do?" answered by the first
paragraphs of its docstring). Both are deterministic and built in seconds with no network,
so tests and laptops need no download. The stdlib is read with `ast`, never imported.
"""

from __future__ import annotations

import ast
import gc
import os
import random
import sysconfig
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import datasets

DEFAULT_BUILTIN_MAX_CHARS = 3_000_000
MIN_DOC_CHARS = 80
"""Docstrings shorter than this are mostly one-line stubs ("Return self."), not prose."""

_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo"}
)
"""Stdlib folders whose text is test fixtures, third-party code or old-syntax sources."""

_DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)

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


# --- the stdlib's documentation, read by both sources ----------------------------------------


def stdlib_sources() -> list[Path]:
    """Sorted stdlib ``.py`` files, minus tests, IDLE, lib2to3 and installed packages."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[Path] = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS and d != "__pycache__"]
        found.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(found)


def _stdlib_docs() -> Iterator[tuple[str, str, str]]:
    """(kind, dotted name, docstring) of each stdlib module, class and function, file by
    file in `stdlib_sources` order and in source order within a file, lazily."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_sources():
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        yield from _file_docs(path, module)


def _file_docs(path: Path, module: str) -> list[tuple[str, str, str]]:
    """One file's (kind, name, docstring) rows; none where it does not parse. Parsed and
    read with the GC paused, the tree dropped before it resumes."""
    with _gc_paused(), warnings.catch_warnings():  # old sources warn on invalid escapes
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):
            return []
        rows = []
        for node in _definitions(tree):
            if isinstance(node, ast.Module):
                kind, name = "module", module
            else:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                name = f"{module}.{node.name}"
            rows.append((kind, name, ast.get_docstring(node, clean=True) or ""))
        return rows


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while a file is parsed.

    ``ast.parse`` allocates a node per syntax element and each allocation burst triggers a GC
    pass over every live object; pausing it makes parsing the stdlib about 3x faster. The tree
    is dropped right after, so no garbage accumulates.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _definitions(tree: ast.Module) -> Iterator[ast.AST]:
    """The module, then its classes and functions in source order, visiting statements only.

    Docstrings live only on these nodes, so expressions (most of the tree) are never walked;
    definitions nested in ``if``/``try``/``with`` blocks are still found.
    """
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, _DOCSTRING_NODES):
            yield node
        children = [
            child
            for field in ("body", "orelse", "finalbody", "handlers", "cases")
            for child in getattr(node, field, ())
            if isinstance(child, ast.stmt | ast.excepthandler | ast.match_case)
        ]
        stack.extend(reversed(children))


def _help_topics() -> Iterator[tuple[str, str]]:
    """(name, text) of the interactive help's topics, in name order."""
    from pydoc_data.topics import topics  # noqa: PLC0415 - a 1 MB module, read on demand

    for key in sorted(topics):
        yield key, topics[key]


# --- data.source=builtin: a text corpus ------------------------------------------------------


def builtin_corpus(max_chars: int | None = None) -> datasets.Dataset:
    """Whole documents in a fixed order until the next one would pass ``max_chars``
    (None: DEFAULT_BUILTIN_MAX_CHARS), each once."""
    max_chars = DEFAULT_BUILTIN_MAX_CHARS if max_chars is None else max_chars
    if max_chars <= 0:
        raise ValueError(f"data.builtin_max_chars must be positive; got {max_chars}")
    docs: list[str] = []
    seen: set[str] = set()
    total = 0
    for doc in _builtin_documents():
        if doc in seen:  # identical docstrings are common; duplicates would leak across splits
            continue
        if total + len(doc) > max_chars:
            break
        seen.add(doc)
        docs.append(doc)
        total += len(doc)
    if not docs:
        raise ValueError(
            f"data.builtin_max_chars={max_chars} is smaller than the first builtin document; "
            "raise it"
        )
    return datasets.Dataset.from_dict({"text": docs})


def _builtin_documents() -> Iterator[str]:
    """Yield help topics then stdlib docstrings, lazily, so a small cap parses few files."""
    for _, text in _help_topics():
        text = text.strip()
        if len(text) >= MIN_DOC_CHARS:
            yield text
    for _, _, text in _stdlib_docs():
        text = text.strip()
        if len(text) >= MIN_DOC_CHARS:
            yield text


# --- data.source=builtin_instructions: conversations -----------------------------------------


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


def builtin_preferences(max_chars: int | None = None) -> datasets.Dataset:
    """Preference pairs made offline from the builtin conversations: the prompt is a
    conversation's turns before its last answer, chosen that answer, rejected the same
    answer with the words of each line shuffled (seeded by the pair's number): the same
    words, no longer sentences, a preference a model can learn and carry to new pairs."""
    rows: dict[str, list] = {"prompt": [], "chosen": [], "rejected": []}
    total = 0
    for number, turns in enumerate(builtin_conversations()):
        size = sum(len(turn["content"]) for turn in turns)
        if max_chars is not None and total + size > max_chars:
            break
        total += size
        answer = turns[-1]["content"]
        garbled = _shuffled_words(answer, random.Random(number))
        if garbled == answer:
            continue
        rows["prompt"].append(turns[:-1])
        rows["chosen"].append([turns[-1]])
        rows["rejected"].append([{"role": "assistant", "content": garbled}])
    if not rows["prompt"]:
        raise ValueError(f"data.builtin_max_chars={max_chars} holds no conversation; raise it")
    return datasets.Dataset.from_dict(rows)


def _shuffled_words(text: str, rng: random.Random) -> str:
    """`text` with the words of each line in a random order (the lines kept)."""
    lines = []
    for line in text.split("\n"):
        words = line.split(" ")
        rng.shuffle(words)
        lines.append(" ".join(words))
    return "\n".join(lines)


def builtin_conversations() -> Iterator[list[dict[str, str]]]:
    """Conversations in a fixed order: one question, or two (every fifth), or a system
    prompt first (every seventh)."""
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


def _questions() -> Iterator[tuple[str, str]]:
    """(question, answer) pairs, each documentation text at most once; the wording varies."""
    seen: set[str] = set()
    for number, (kind, name, text) in enumerate(_documented()):
        answer = short_answer(text)
        if len(answer) < MIN_ANSWER_CHARS or answer in seen:
            continue
        seen.add(answer)
        wordings = TOPIC_QUESTIONS if kind == "topic" else DEFINITION_QUESTIONS[kind]
        yield wordings[number % len(wordings)].format(name=name), answer


def _documented() -> Iterator[tuple[str, str, str]]:
    """(kind, dotted name, documentation) of each help topic, then of each public stdlib
    module, class and function."""
    for key, text in _help_topics():
        yield "topic", key, text
    for kind, name, text in _stdlib_docs():
        if not name.split(".")[-1].startswith("_"):
            yield kind, name, text
