"""Tensor parallelism: per-rank model states, step peak and collectives for tp = 1, 2, 4.

Per tp (world = tp), with and without sequence parallelism, one spawned group runs the
real `Trainer`: two steps (the second its memory probe: the step's peak beside the
planner's), then one `train_step` under `CommDebugMode`, each collective noted with its
phase and bytes, beside Megatron's count for the layout (docs/benchmarks.md, "Tensor
parallelism"). Nothing is asserted.

    .venv/bin/python bench/tensor_parallel.py [--hidden 512] [--layers 4] [--tp 1 2 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from collections import Counter
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_runs import (
    MIB,
    add_model_arguments,
    llama_fields,
    planned_side,
    step_and_log,
    token_blocks,
    trainer_group,
)
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor.debug import CommDebugMode

from meshtrain.config import LaunchConfig
from meshtrain.distributed.kv_heads import kv_replication_factor
from meshtrain.launch.elastic import run_workers
from meshtrain.trainer import Trainer

PHASES = ("fwd", "bwd", "step")  # forward + loss, backward, the step's own collectives
KINDS = ("AR", "AG", "RS", "A2A", "other")
KIND_NAMES = {
    "AR": ("all_reduce", "allreduce"),
    "AG": ("all_gather", "allgather"),
    "RS": ("reduce_scatter",),
    "A2A": ("all_to_all", "alltoall"),
}


def _collective_kind(name: str) -> str:
    for kind, words in KIND_NAMES.items():
        if any(word in name for word in words):
            return kind
    return "other"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _payload(kind: str, func_name: str, args: tuple, group_size: int) -> int:
    """Bytes of the whole tensor a collective works on: the reduced tensor, the gathered
    output, the input before scattering. Functional collectives (DTensor's) receive only
    the input; c10d ops (meshtrain's own calls) their output and input buffers."""
    tensors = _tensors(args)
    if not tensors:
        return 0
    if func_name.startswith("c10d."):  # c10d ops: (output(s), input(s), group, ...)
        if kind in ("AG", "RS") and len(args) > 1:  # the gathered output / the full input
            return max(sum(_nbytes(t) for t in _tensors(args[i])) for i in (0, 1))
        return sum(_nbytes(t) for t in _tensors(args[0]))
    if kind == "AG":
        return _nbytes(tensors[0]) * group_size
    return sum(_nbytes(t) for t in tensors)


def ring_bytes(kind: str, payload: int, group_size: int) -> float:
    """Bytes one rank sends for a collective in a ring algorithm (bandwidth-optimal)."""
    if group_size <= 1:
        return 0.0
    share = (group_size - 1) / group_size
    return 2 * share * payload if kind == "AR" else share * payload


class RecordingCommMode(CommDebugMode):
    """CommDebugMode that also notes each collective's phase and bytes: backward while
    autograd runs a graph task; else meshtrain's own c10d calls (gradient norm, the
    ranks' agreement, KV-copy sync) the step's, DTensor's functional ones the forward's."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.tp = tp
        self.events: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented or sum(self.comm_counts.values()) == before:
            return out
        name = f"{func._overloadpacket._qualified_op_name}".replace("::", ".")
        kind = _collective_kind(name)
        group_size = self.tp
        for arg in args:
            if hasattr(arg, "size") and not isinstance(arg, torch.Tensor):
                with suppress(Exception):  # a c10d ProcessGroup (as a ScriptObject) has a size
                    group_size = int(arg.size())
        if kind in ("AG", "RS") and not name.startswith("c10d."):
            ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
            group_size = ints[0] if ints else group_size
        phase = "bwd" if self.advanced_module_tracker.is_bw else "fwd"
        phase = "step" if phase == "fwd" and name.startswith("c10d.") else phase
        payload = _payload(kind, name, args, group_size)
        self.events.append(
            {
                "phase": phase,
                "kind": kind,
                "payload": payload,
                "ring": ring_bytes(kind, payload, group_size),
            }
        )
        return out


@record
def tp_worker(spec: Any) -> dict[str, Any] | None:
    """Two steps of the real Trainer (the second its memory probe), one more with every
    collective recorded; rank 0 returns its summary and the collectives."""
    # Module hooks of the trackers on HF modules (which return dataclasses) warn.
    warnings.filterwarnings("ignore", message=".*backward hook.*")
    with trainer_group(spec):
        trainer = Trainer(spec)
        for step in range(2):
            step_and_log(trainer, step)
        comm = RecordingCommMode(trainer.dims.tp)
        with comm:
            trainer.train_step(2)
        trainer.optimizer.wait_for_parameters()
        if dist.get_rank() != 0:
            return None
        return {"summary": trainer.summary(None, None, 0.0), "events": comm.events}


def theoretical(tp: int, sp: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Megatron-style tensor-parallel collectives of one training step, with payloads
    (the count per layer and outside them: docs/benchmarks.md, "Tensor parallelism").
    Per layer 2 all-reduces forward and 2 backward (with SP: an all-gather and a
    reduce-scatter each), plus the embedding / LM-head boundary, loss_parallel's 3
    forward all-reduces, SP's norm-weight gradients, and the step's own: the gradient
    norm, the ranks' agreement, one per replicated k/v weight."""
    counts: dict[str, Counter] = {phase: Counter() for phase in PHASES}
    payload: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    ring: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    layers, hidden = args.layers, args.hidden
    token_bytes = args.batch * args.seq * 4
    hidden_bytes = token_bytes * hidden

    def add(phase: str, kind: str, n: int, size: float, group: int = tp) -> None:
        counts[phase][kind] += n
        payload[phase] += n * size
        ring[phase] += n * ring_bytes(kind, size, group)

    add("step", "AR", 1, 4)  # every rank agrees on the step (a stop signal, finite values)
    if tp == 1:
        return {"counts": counts, "payload": payload, "ring": ring}

    blocks = 2 * layers + 1  # two per layer, plus the embedding / LM-head boundary
    if sp:
        for phase in ("fwd", "bwd"):
            add(phase, "AG", blocks, hidden_bytes)
            add(phase, "RS", blocks, hidden_bytes)
        add("bwd", "AR", blocks, hidden * 4)  # the norm weights' gradients
    else:
        add("fwd", "AR", blocks, hidden_bytes)
        add("bwd", "AR", blocks, hidden_bytes)
    add("fwd", "AR", 3, token_bytes)
    add("step", "AR", 1, 4)
    kv_replication = kv_replication_factor(args.kv_heads, tp)
    if kv_replication > 1:
        add("step", "AR", 2 * layers, hidden // args.heads * hidden * 4, kv_replication)
    return {"counts": counts, "payload": payload, "ring": ring}


def _fmt_counts(counter: Counter) -> str:
    parts = [f"{counter[k]} {k}" for k in KINDS if counter.get(k)]
    return " + ".join(parts) if parts else "-"


def memory_lines(rows: list[tuple[str, dict, Any]]) -> list[str]:
    """Model states and the step's peak of live tensors, measured beside the planner."""
    lines = [
        "",
        "Memory per rank (rank 0's model states; the step peak is the largest rank's; MiB)",
        "| tp | SP | model states | planner | / tp=1 | step peak | planner |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = rows[0][1]["summary"]["model_states_bytes_rank0"]
    for name, result, plan in rows:
        summary, memory = result["summary"], plan.memory_estimate_per_rank
        states = summary["model_states_bytes_rank0"]
        predicted = memory["parameters"] + memory["gradients"] + memory["optimizer_states"]
        peak = summary["measured_peak_memory"]
        tp, sp = name.split("-")
        lines.append(
            f"| {tp[2:]} | {sp} | {states / MIB:,.2f} | {predicted / MIB:,.2f} | "
            f"{states / base:.3f} | {peak['peak_bytes'] / MIB:,.1f} | "
            f"{peak['predicted_peak_bytes'] / MIB:,.1f} |"
        )
    return lines


def collective_lines(rows: list[tuple[str, dict, Any]], args: argparse.Namespace) -> list[str]:
    """Per phase, the collectives measured on rank 0 beside Megatron's count."""
    lines = [
        "",
        "Collectives per training step, rank 0 (measured | Megatron theory); MiB: payload, "
        "and what one rank sends in a ring",
        "| tp | SP | fwd | bwd | step | theory fwd | theory bwd | theory step | payload | "
        "theory | sent | theory |",
        "|---:|---:|---|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for _name, result, plan in rows:
        tp, sp = plan.layout.tensor_parallel_size, plan.layout.sequence_parallel
        counts = {phase: Counter() for phase in PHASES}
        payload = ring = 0.0
        for event in result["events"]:
            counts[event["phase"]][event["kind"]] += 1
            payload, ring = payload + event["payload"], ring + event["ring"]
        theory = theoretical(tp, sp, args)
        cells = [_fmt_counts(counts[p]) for p in PHASES]
        cells += [_fmt_counts(theory["counts"][p]) for p in PHASES]
        cells += [f"{payload / MIB:.2f}", f"{sum(theory['payload'].values()) / MIB:.2f}"]
        cells += [f"{ring / MIB:.2f}", f"{sum(theory['ring'].values()) / MIB:.2f}"]
        lines.append(f"| {tp} | {'yes' if sp else 'no'} | {' | '.join(cells)} |")
    lines.append("AR all-reduce, AG all-gather, RS reduce-scatter (theory: `theoretical`)")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, 512, 1408, 4, 8, 4, 8192, 256, 4)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    if args.tp[0] != 1:
        parser.error("--tp starts with 1: the ratios are taken against it")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = llama_fields(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mt-tp-") as tmp:
        root = Path(tmp)
        blocks = token_blocks(root / "blocks", 4 * args.batch + 4, args.vocab, args.seq)
        for tp in args.tp:
            for sp in (False, True) if tp > 1 else (False,):
                name = f"tp{tp}-{'yes' if sp else 'no'}"
                spec, plan = planned_side(
                    blocks,
                    root,
                    name,
                    world=tp,
                    parallel={"tensor_parallel_size": tp, "sequence_parallel": sp},
                    training={"per_device_train_batch_size": args.batch, "max_steps": 3},
                    shape=shape,
                    vocab=args.vocab,
                    block=args.seq,
                )
                print(f"== {name}: {plan.layout.name}", flush=True)
                (result,) = [
                    r
                    for r in run_workers(
                        tp_worker,
                        (spec,),
                        LaunchConfig(nproc_per_node=tp),
                        log_dir=root / "logs" / name,
                        run_id=name,
                    ).values()
                    if r is not None
                ]
                rows.append((name, result, plan))
    print(f"\ncommand: .venv/bin/python {' '.join(sys.argv)}")
    print("\n".join(memory_lines(rows) + collective_lines(rows, args)))


if __name__ == "__main__":
    main()
