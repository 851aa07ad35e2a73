"""Layout sweeps: the same data and model trained under several layouts, compared side by side.

A layout shorthand names a whole layout in a few letters, the way people say it:
`dp2`, `tp2`, `pp2`, `dp2xtp2`, `tp2xpp2-gpipe-mb8`, `dp4-nozero1`, `dp4-sdp4`, `dp2-cp2`,
`cp4`, `dp4-ep2`. This module
turns such strings into `--params` overrides and holds the global batch fixed
across the layouts (the layout-independence contract compares runs at the
same global batch; the planner splits it per layout); the comparison table from
the MLflow runs is `tracking.sweep_table`'s (this module imports neither MLflow
nor pandas, so `kedro`'s command line loads it at once).
Running the layouts is the caller's business (`meshtrain.cli`'s `kedro sweep`);
nothing here imports Kedro.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from meshtrain.config import LaunchConfig, ParallelConfig, TrainingConfig, parse

# Tags every run of one sweep carries (set by the sweep command through MLflow's run context).
SWEEP_TAG = "meshtrain.sweep"
SWEEP_LAYOUT_TAG = "meshtrain.sweep.layout"
SWEEP_STATUS_TAG = "meshtrain.sweep.status"
SWEEP_ERROR_TAG = "meshtrain.sweep.error"
SWEEP_STAGE_TAG = "meshtrain.sweep.stage"

_SIZE = re.compile(r"^(sdp|dp|tp|pp|cp|ep|mb|v)(\d+)$")
_SIZE_PARAMS = {
    "sdp": "parallel.sharded_data_parallel_degree",
    "dp": "parallel.data_parallel_size",
    "tp": "parallel.tensor_parallel_size",
    "pp": "parallel.pipeline_parallel_size",
    "cp": "parallel.context_parallel_size",
    # Expert parallelism takes its ranks from dp: it does not multiply the world.
    "ep": "parallel.expert_parallel_size",
    "mb": "parallel.pipeline_parallel_num_microbatches",
    "v": "parallel.pipeline_parallel_virtual_stages",
}
# Flag tokens: token -> (parameter, value). Opposites share a parameter, so giving both
# is caught as "given twice".
_FLAGS: dict[str, tuple[str, Any]] = {
    "zero1": ("parallel.zero_1", True),
    "nozero1": ("parallel.zero_1", False),
    "nosdp": ("parallel.sharded_data_parallel_degree", 1),
    "sp": ("parallel.sequence_parallel", True),
    "nosp": ("parallel.sequence_parallel", False),
    "ac": ("parallel.activation_checkpointing", "full"),
    "noac": ("parallel.activation_checkpointing", "none"),
    "gpipe": ("parallel.pipeline_schedule", "gpipe"),
    "1f1b": ("parallel.pipeline_schedule", "1f1b"),
    "interleaved_1f1b": ("parallel.pipeline_schedule", "interleaved_1f1b"),
    "i1f1b": ("parallel.pipeline_schedule", "interleaved_1f1b"),
    "interleaved_zb": ("parallel.pipeline_schedule", "interleaved_zb"),
    "izb": ("parallel.pipeline_schedule", "interleaved_zb"),
    "zbv": ("parallel.pipeline_schedule", "zbv"),
    "dualpipev": ("parallel.pipeline_schedule", "dualpipev"),
}
GRAMMAR = (
    "a layout is tokens joined by 'x' or '-': dpN, tpN, ppN, cpN (N a whole number >= 1; "
    "tp, pp and cp (context parallel) default to 1, dp to auto = the rest of the world "
    "size), and optionally "
    f"{', '.join(_FLAGS)}, mbN (pipeline microbatches), vN (virtual stages per rank), "
    "sdpN (sharded data parallel degree: N divides dp; N = dp shards fully), epN (expert "
    "parallel: a mixture of experts' experts over N of the dp ranks; N divides dp). "
    "Examples: dp2, tp2, pp2, dp2xtp2, tp2xpp2-gpipe-mb8, dp4-nozero1, dp2xtp2-ac, dp4-sdp4, "
    "dp2-cp2, cp4, dp4-ep2"
)


class ShorthandError(ValueError):
    """A layout shorthand cannot be read; the message names the token, why, and what works."""


@dataclass(frozen=True)
class LayoutShorthand:
    """One layout of a sweep: the string as given and the parameters it sets."""

    text: str
    params: dict[str, Any]

    @property
    def explicit_dp(self) -> int | None:
        return self.params.get("parallel.data_parallel_size")

    @property
    def tp(self) -> int:
        return self.params["parallel.tensor_parallel_size"]

    @property
    def pp(self) -> int:
        return self.params["parallel.pipeline_parallel_size"]

    @property
    def cp(self) -> int:
        return self.params["parallel.context_parallel_size"]

    @property
    def model_ranks(self) -> int:
        """The ranks besides dp: tp x pp x cp (the world is dp times these)."""
        return self.tp * self.pp * self.cp


def parse_shorthand(text: str) -> LayoutShorthand:
    """`"dp2xtp2-zero1"` -> the `parallel.*` parameters it names.

    tp, pp and cp not named are 1 (a layout shorthand describes the whole layout); dp not
    named stays `auto` (the world size over tp x pp, as in `kedro run`). Anything
    else not named keeps the project's configured value (ep's is 1 unless changed).
    """
    original = text
    text = text.strip().lower().replace("ac-full", "ac")
    if not text:
        raise ShorthandError(f"layout {original!r} is empty: {GRAMMAR}")
    params: dict[str, Any] = {}
    given_by: dict[str, str] = {}
    for token in re.split(r"[x\-]", text):
        if not token:
            raise ShorthandError(
                f"layout {original!r} has an empty token (two separators in a row, or one "
                f"at an end): {GRAMMAR}"
            )
        size = _SIZE.match(token)
        if size:
            prefix, number = size.group(1), int(size.group(2))
            if number < 1:
                raise ShorthandError(
                    f"layout {original!r}: token {token!r} asks for {prefix}={number}, but "
                    f"sizes start at 1: {GRAMMAR}"
                )
            name, value = _SIZE_PARAMS[prefix], number
        elif token in _FLAGS:
            name, value = _FLAGS[token]
        else:
            hint = ""
            if re.fullmatch(r"(sdp|dp|tp|pp|cp|ep|mb|v)", token):
                hint = f" (it needs a number, e.g. {token}2)"
            raise ShorthandError(
                f"layout {original!r}: token {token!r} is not understood{hint}; {GRAMMAR}"
            )
        if name in params:
            raise ShorthandError(
                f"layout {original!r}: tokens {given_by[name]!r} and {token!r} both set "
                f"{name}; give it once"
            )
        params[name] = value
        given_by[name] = token
    _check_sharding_beside_zero_1(original, params, given_by)
    params.setdefault("parallel.tensor_parallel_size", 1)
    params.setdefault("parallel.pipeline_parallel_size", 1)
    params.setdefault("parallel.context_parallel_size", 1)
    return LayoutShorthand(text=original.strip(), params=params)


def _check_sharding_beside_zero_1(
    original: str, params: dict[str, Any], given_by: dict[str, str]
) -> None:
    """`zero1` with `sdpN` (N > 1) asks for ZeRO-1 twice: sharding already includes it."""
    degree = params.get("parallel.sharded_data_parallel_degree", 1)
    if degree > 1 and params.get("parallel.zero_1") is True:
        raise ShorthandError(
            f"layout {original!r}: tokens {given_by['parallel.zero_1']!r} and "
            f"{given_by['parallel.sharded_data_parallel_degree']!r} both shard the optimizer "
            "states (sharded data parallelism includes ZeRO-1); drop 'zero1'"
        )


def parse_shorthands(text: str) -> list[LayoutShorthand]:
    """`"dp2 tp2 pp2"` (spaces or commas between layouts) -> one spec each, in order."""
    items = [item for item in re.split(r"[\s,]+", text.strip()) if item]
    if not items:
        raise ShorthandError(f"--layouts is empty; give one or more layouts: {GRAMMAR}")
    specs = [parse_shorthand(item) for item in items]
    seen: dict[tuple, str] = {}
    for spec in specs:
        key = tuple(sorted(spec.params.items()))
        if key in seen:
            raise ShorthandError(
                f"layouts {seen[key]!r} and {spec.text!r} are the same layout; list it once"
            )
        seen[key] = spec.text
    return specs


@dataclass
class SweepEntry:
    """One layout as the sweep will run it, or why it cannot be set up."""

    spec: LayoutShorthand
    overrides: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def layout(self) -> str:
        return self.spec.text

    def params_arg(self, extra: dict[str, Any] | None = None) -> str:
        """The overrides as a `kedro run --params` string."""
        return to_params_arg({**self.overrides, **(extra or {})})


def to_params_arg(values: dict[str, Any]) -> str:
    """`{"parallel.zero_1": False, "launch.nproc_per_node": 4}` ->
    `"parallel.zero_1=false,launch.nproc_per_node=4"` (Kedro's `--params` format)."""
    parts = []
    for key, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if "," in text:
            raise ValueError(f"{key}={text}: a --params value cannot contain a comma")
        parts.append(f"{key}={text}")
    return ",".join(parts)


def plan_sweep(
    specs: list[LayoutShorthand],
    params: dict[str, Any],
    global_batch_size: int | None = None,
) -> tuple[int, list[SweepEntry]]:
    """Per-layout `--params` overrides, all at one global batch.

    `params` are the project's parameters with the user's overrides applied. Every
    layout gets `training.global_batch_size`, which the planner splits into that
    layout's per-device batch and accumulation steps (or refuses, when dp does not
    divide it). The batch is `global_batch_size` when given, else the configured
    `training.global_batch_size`, else the configured per-device batch x accumulation
    x the largest dp among the layouts. A layout naming dp fixes the world size
    (`launch.nproc_per_node`); one the nodes cannot share gets an `error` instead of
    overrides. The planner judges everything else.

    Returns: the global batch and one entry per layout.
    """
    training = parse(TrainingConfig, params.get("training"), "training")
    launch = parse(LaunchConfig, params.get("launch"), "launch")
    parse(ParallelConfig, params.get("parallel"), "parallel")  # refuse typos before any run
    configured = training.global_batch_size
    if global_batch_size is not None and configured not in (None, global_batch_size):
        raise ValueError(
            f"--global-batch-size={global_batch_size} and training.global_batch_size="
            f"{configured} disagree; give one of them"
        )
    batch = global_batch_size or configured
    if batch is None:
        world = launch.nproc_per_node * launch.nnodes
        dps = [
            spec.explicit_dp or world // spec.model_ranks
            for spec in specs
            if spec.explicit_dp or world % spec.model_ranks == 0
        ]
        batch = (
            training.per_device_train_batch_size
            * training.gradient_accumulation_steps
            * max(dps, default=1)
        )
    if batch < 1:
        raise ValueError(f"--global-batch-size={batch}: it must be at least 1")

    entries = []
    for spec in specs:
        entry = SweepEntry(spec, overrides=dict(spec.params))
        entries.append(entry)
        if spec.explicit_dp is not None:
            world = spec.explicit_dp * spec.model_ranks
            if world % launch.nnodes:
                entry.error = (
                    f"layout {spec.text!r} needs {world} processes (dp x tp x pp x cp), which "
                    f"launch.nnodes={launch.nnodes} nodes cannot share equally; use a layout "
                    f"whose dp x tp x pp x cp is a multiple of {launch.nnodes}, or change "
                    "launch.nnodes"
                )
                continue
            entry.overrides["launch.nproc_per_node"] = world // launch.nnodes
        elif (launch.nproc_per_node * launch.nnodes) % spec.model_ranks:
            # dp=auto cannot fill this world: the planner refuses the sizes themselves, and
            # its message about those is the useful one (a global batch would be refused
            # first, "over data_parallel_size=0").
            continue
        entry.overrides["training.global_batch_size"] = batch
    return batch, entries


def new_sweep_id() -> str:
    """A readable, unique id: when the sweep started, plus a few random letters."""
    return time.strftime("sweep-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def layout_error(output: str) -> str | None:
    """The planner's refusal (`LayoutError: ...` and its `  - parameter: why` items) in a
    run's output, with lines the terminal wrapped joined back; None if absent."""
    lines = output.splitlines()
    start = next(
        (i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("LayoutError:")), None
    )
    if start is None:
        return None
    found = [lines[start].removeprefix("LayoutError:").strip()]
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        if line.startswith("  - "):
            found.append("  - " + line[4:].strip())
        else:  # a wrapped continuation, printed from column 0
            found[-1] = found[-1].rstrip() + " " + line.strip()
    return "\n".join(found)
