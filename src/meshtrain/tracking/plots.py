"""Pictures for MLflow and the docs, drawn with matplotlib's file-only backend."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from meshtrain.distributed.pipeline_parallel import Span, idle_fraction  # noqa: E402

_COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "weight": "#55A868"}


def pipeline_timeline(spans_by_rank: dict[int, list[Span]], path: Path, title: str) -> Path:
    """One row per pipeline rank, a bar per forward (blue), backward (orange) or, under a
    zero-bubble schedule, weight-gradient (green) chunk,
    labelled with its microbatch; the white gaps are the bubble."""
    origin = min(s.start for spans in spans_by_rank.values() for s in spans)
    idle = idle_fraction(spans_by_rank)
    ranks = sorted(spans_by_rank)
    figure, axes = plt.subplots(figsize=(11, 0.7 * len(ranks) + 1.4))
    for row, rank in enumerate(ranks):
        for span in spans_by_rank[rank]:
            start_ms = (span.start - origin) * 1e3
            width_ms = (span.end - span.start) * 1e3
            axes.barh(row, width_ms, left=start_ms, color=_COLOURS[span.kind], edgecolor="white")
            axes.text(
                start_ms + width_ms / 2, row, str(span.microbatch),
                ha="center", va="center", fontsize=7, color="white",
            )  # fmt: skip
    axes.set_yticks(
        range(len(ranks)), [f"pp rank {r} (idle {idle[r]:.0%})" for r in ranks], fontsize=8
    )
    axes.invert_yaxis()
    axes.set_xlabel("milliseconds since the step began")
    axes.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    axes.legend(handles, list(_COLOURS), loc="upper right", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def loss_curve(history: dict[str, list[tuple[int, float]]], path: Path, title: str) -> Path:
    """Loss against step, one line per series (training loss solid, validation loss
    dashed with markers: it is measured only every `eval_every` steps)."""
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, points in history.items():
        if not points:
            continue
        steps, values = zip(*sorted(points), strict=True)
        validation = name.startswith("val")
        axes.plot(
            steps,
            values,
            label=name,
            linestyle="--" if validation else "-",
            marker="o" if validation else None,
        )
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy loss (nats per token)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


_MEMORY_PARTS = {
    "parameters": "#4C72B0",
    "gradients": "#55A868",
    "optimizer_states": "#C44E52",
    "activations": "#DD8452",
    "loss": "#937860",
}


def memory_breakdown(
    predicted: dict[str, int | list[int]],
    measured_per_rank: list[int],
    ranks_per_stage: int,
    path: Path,
    title: str,
) -> Path:
    """Left: the planner's breakdown of the peak rank, stacked, beside the measured peak.
    Right: every rank's predicted total (by its pipeline stage) beside its measured peak."""
    mib = 2**20
    figure, (left, right) = plt.subplots(
        1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.6]}
    )
    bottom = 0.0
    for part, colour in _MEMORY_PARTS.items():
        value = predicted[part] / mib
        left.bar(0, value, bottom=bottom, color=colour, label=part.replace("_", " "))
        bottom += value
    left.bar(1, max(measured_per_rank) / mib, color="#333333", label="measured peak")
    left.set_xticks([0, 1], ["predicted", "measured"])
    left.set_ylabel("MiB")
    left.set_title("peak rank", fontsize=9)
    left.set_xlim(-0.6, 2.6)  # room on the right for the legend
    left.legend(fontsize=7, loc="upper right")

    stage_totals = predicted.get("total_per_pipeline_rank") or [predicted["total"]]
    ranks = range(len(measured_per_rank))
    expected = [stage_totals[r // ranks_per_stage] / mib for r in ranks]
    right.bar([r - 0.2 for r in ranks], expected, width=0.4, color="#4C72B0", label="predicted")
    right.bar(
        [r + 0.2 for r in ranks],
        [b / mib for b in measured_per_rank],
        width=0.4,
        color="#333333",
        label="measured",
    )
    right.set_xticks(list(ranks), [f"rank {r}" for r in ranks], fontsize=8)
    right.set_title("every rank", fontsize=9)
    right.legend(fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
