"""The progress bar on stderr, without making every run pay for importing tqdm first."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Protocol


class Bar(Protocol):
    """What the copy reports progress to: a tqdm bar, or nothing."""

    def update(self, n: int = 1) -> Any: ...

    def set_postfix_str(self, text: str) -> Any: ...


class NoBar:
    """Stands in for tqdm when no progress is shown (and tqdm is not imported)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def __enter__(self) -> NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Progress:
    """A tqdm bar on stderr, created once tqdm is imported: the import (about 0.1 s, most
    of it `importlib.metadata` finding tqdm's version) runs on a thread while the first
    bytes are copied, and what is counted meanwhile shows as the bar's start."""

    def __init__(self, total: int, desc: str) -> None:
        self._options = {
            "total": total,
            "unit": "B",
            "unit_scale": True,
            "desc": desc,
            "file": sys.stderr,
        }
        self._bar: Any = None
        self._count = 0
        self._postfix: str | None = None
        self._loader = threading.Thread(target=self._load, name="import-tqdm", daemon=True)
        self._loader.start()

    @staticmethod
    def _load() -> None:
        with contextlib.suppress(ImportError):  # raised again, with its traceback, below
            import tqdm  # noqa: F401

    def _ready(self, *, wait: bool = False) -> bool:
        if self._bar is None and (wait or not self._loader.is_alive()):
            self._loader.join()
            from tqdm import tqdm

            self._bar = tqdm(initial=self._count, **self._options)
            if self._postfix is not None:
                self._bar.set_postfix_str(self._postfix, refresh=False)
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        if self._ready():
            self._bar.update(n)
        else:
            self._count += n

    def set_postfix_str(self, text: str) -> None:
        self._postfix = text
        if self._ready():
            self._bar.set_postfix_str(text, refresh=False)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._ready(wait=True)
        self._bar.close()
