"""How a `kedro run` that meshtrain refused ends: the refusal's message, no traceback.

Installed by the project's config loader and MLflow hook when a Kedro session starts;
`refusal_in` also tells the hook (and the CLI) a deliberate refusal from a failure."""

from __future__ import annotations

import os
import sys
from typing import Any

from meshtrain.config_parsing import Refused

# Set to 1 for the full traceback of a refusal.
TRACEBACK_VARIABLE = "MESHTRAIN_TRACEBACK"


def refusal_in(error: BaseException | None) -> Refused | None:
    """The deliberate refusal behind `error` (itself, or what it was raised from)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Refused):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def show_refusals_plainly() -> None:
    """End a `kedro run` that meshtrain refused with the refusal's message alone, instead
    of a traceback through Kedro's and meshtrain's frames; unexpected errors, and every
    error with MESHTRAIN_TRACEBACK=1, keep the traceback. Wraps the exception hook in
    place when the project starts (after Kedro installed rich's), once."""
    previous = sys.excepthook
    if getattr(previous, "meshtrain_refusals", False):
        return

    def hook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        refusal = refusal_in(error)
        if refusal is None or os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
            previous(kind, error, traceback)
            return
        sys.stderr.write(
            f"{type(refusal).__name__}: {refusal}\n\n"
            f"(meshtrain refused the run; {TRACEBACK_VARIABLE}=1 shows the traceback)\n"
        )

    hook.meshtrain_refusals = True  # type: ignore[attr-defined]
    sys.excepthook = hook
