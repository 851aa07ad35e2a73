"""Pictures for MLflow and the docs, drawn with matplotlib's file-only backend."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from meshtrain.parallel.pipeline_parallel import Span, idle_fraction  # noqa: E402

_COLOURS = {"forward": "#4C72B0", "backward": "#DD8452"}


def pipeline_timeline(spans_by_rank: dict[int, list[Span]], path: Path, title: str) -> Path:
    """One row per pipeline rank, a bar per forward (blue) or backward (orange) chunk,
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
