"""Parameter dicts into typed dataclasses: unknown names and wrong kinds refused by name.

`config` declares the groups; this is how a group's plain dict (from YAML, a
`--params` string, a test) becomes one, and the refusals' base classes.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal


class Refused(Exception):
    """meshtrain refused an input on purpose; the message names it, why, and what works.

    The base of every deliberate refusal (configuration, layout, data, checkpoints,
    launch), so `kedro run` can end with the message alone
    (`refusals.show_refusals_plainly`) while unexpected errors keep their
    tracebacks."""


class ConfigError(Refused, ValueError):
    """A parameter has a value meshtrain cannot use; the message names it."""


_POSITIVE_INTS = {
    "data_parallel_size",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "pipeline_parallel_num_microbatches",
    "pipeline_parallel_virtual_stages",
    "context_parallel_size",
    "expert_parallel_size",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "global_batch_size",
    "max_steps",
    "checkpoint_every",
    "eval_every",
    "log_every",
    "nproc_per_node",
    "nnodes",
    "vocab_size",
    "block_size",
    "batch_size",
    "max_batches",
    "max_new_tokens",
}

# Names that may be numbers (a job id), so a number is read as the name it spells.
_NAMES = {"rdzv_id", "run_name"}


def parse(cls: type, values: dict[str, Any] | None, group: str):
    """Build dataclass `cls` from a parameter dict, refusing unknown keys and bad kinds; a
    field whose type is itself such a group (`model.lora`) is parsed by that class's
    `from_params(values, dotted)`, else field by field."""
    if isinstance(values, cls):
        return values
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, fields, n=1)
        hint = f"; did you mean `{group}.{close[0]}`?" if close else "."
        raise ConfigError(
            f"`{group}.{name}` is not a meshtrain parameter{hint} "
            f"Known `{group}.*` parameters: {', '.join(sorted(fields))}."
        )
    parsed = {}
    for name, value in values.items():
        if name in _NAMES and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # Kedro reads `launch.rdzv_id=$SLURM_JOB_ID` as a number
        parsed[name] = _coerce(value, hints[name], f"{group}.{name}")
        if name in _POSITIVE_INTS and isinstance(parsed[name], int) and parsed[name] < 1:
            raise ConfigError(f"`{group}.{name}` must be at least 1, got {parsed[name]}.")
    return cls(**parsed)


def _coerce(value: Any, hint: Any, dotted: str) -> Any:
    """Accept `value` if it fits type `hint`; `--params` strings are converted when unambiguous."""
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    # `null` spellings mean None wherever None is allowed, before any string reading.
    options = sorted(options, key=lambda option: option is not type(None))
    for option in options:
        if dataclasses.is_dataclass(option) and isinstance(value, dict | option):
            from_params = getattr(option, "from_params", None)
            return from_params(value, dotted) if from_params else parse(option, value, dotted)
        ok, converted = _try(value, option)
        if ok:
            return converted
    example = ""
    if list[int] in options:
        example = (
            f' From --params, separate the numbers with spaces: "{dotted}=3 5"'
            " (Kedro splits --params on commas, and YAML reads 3:5 as the number 185)."
        )
    raise ConfigError(f"`{dotted}` got {value!r}; expected {_describe(hint)}.{example}")


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _try(value: Any, option: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(option)
    if option is type(None):
        return (value is None or value in ("null", "None", "none")), None
    if origin is Literal:
        allowed = typing.get_args(option)
        text = str(value).lower() if isinstance(value, str) else value
        return (text in allowed), text
    if option is bool:
        if isinstance(value, bool):
            return True, value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return True, value.lower() == "true"
        return False, None
    if option is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
            return True, int(value)
        return False, None
    if option is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):
            try:
                return True, float(value)
            except ValueError:
                return False, None
        return False, None
    if option is str:
        return isinstance(value, str), value
    if origin is list:
        (item,) = typing.get_args(option)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            return False, None
        if item is int:
            # `--params` cannot hold a comma (Kedro splits on it): "3 5" or "[3 5]" is [3, 5].
            value = [
                part
                for v in value
                for part in (_number_words(v) if isinstance(v, str) else [v])
                if part != ""
            ]
        items = [_try(v, item) for v in value]
        if all(ok for ok, _ in items):
            return True, [converted for _, converted in items]
        return False, None
    if origin is dict:
        return isinstance(value, dict), dict(value) if isinstance(value, dict) else None
    return False, None


def _number_words(text: str) -> list[str]:
    """`"3 5"`, `"[3 5]"` or `"3,5"` -> ["3", "5"]."""
    return re.split(r"[\s,]+", text.strip().strip("[]").strip())


def _describe(hint: Any) -> str:
    options = typing.get_args(hint) if _is_union(hint) else (hint,)
    words = []
    for option in options:
        if typing.get_origin(option) is Literal:
            words.extend(repr(a) for a in typing.get_args(option))
        elif option is type(None):
            words.append("null")
        elif dataclasses.is_dataclass(option):
            words.append("dict")
        else:
            words.append(getattr(option, "__name__", str(option)))
    return " or ".join(words)


@dataclasses.dataclass(frozen=True)
class Bound:
    """The interval a number parameter must lie in (None: unbounded on that side); NaN
    lies in none."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below


# A row of a range table: the field, its bound, and the refusal, a template of `{value}`
# (the value given) and `{default}` (the field's default).
RangeRow = tuple[str, Bound, str]


def out_of_range(config: Any, rows: tuple[RangeRow, ...]) -> list[str]:
    """The refusals of `config`'s fields outside their bounds, in the rows' order; a
    field at None (an optional one left unset) or `auto` is never out of range."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    problems = []
    for name, bound, message in rows:
        value = getattr(config, name)
        if value is not None and value != "auto" and not bound.holds(value):
            problems.append(message.format(value=value, default=defaults[name]))
    return problems


def check_ranges(config: Any, rows: tuple[RangeRow, ...]) -> None:
    """Refuse the first of `config`'s fields outside its bound."""
    problems = out_of_range(config, rows)
    if problems:
        raise ConfigError(problems[0])


def names_a_path(value: str) -> bool:
    """A parameter naming a file or folder on this machine, not a Hugging Face hub id
    (owner/name): it is written like a path, or something is there."""
    return value.startswith(("/", "./", "../", "~")) or Path(value).expanduser().exists()
