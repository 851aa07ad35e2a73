"""Tensor parallelism benchmark: per-rank memory and collectives for tp = 1, 2, 4.

For each tensor-parallel size (world size = tp, dp = pp = 1) one process group
is spawned with `meshtrain.launch.elastic.run_workers`; inside it the model is built
and parallelised exactly as `meshtrain.trainer.Trainer` does (`build_model` ->
`meshtrain.models.llama.parallelize.parallelize`, i.e. `apply_tensor_parallel` and
`TensorParallelGradSync` -> `FlatParameters` -> `ShardedAdamW`; the loss under
`loss_parallel`), with and without sequence parallelism for tp > 1. After
warm-up steps on random token batches (the same seed on every rank) each
configuration runs

* `--steps` uninstrumented training steps, timed (information only);
* one step under `CommDebugMode` (extended to record the tensors each
  collective moves), giving the collectives per step by phase and type;
* one step under `MemTracker`, giving the activation memory.

Model-state bytes (parameters + gradients + optimizer states) are read exactly
from the flat buffers and the AdamW state tensors. Nothing is asserted about
speed; the script fails only if a rank fails.

    .venv/bin/python bench/tensor_parallel.py [--hidden 512] [--layers 4] ...
"""

from __future__ import annotations

import os

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections import Counter, defaultdict  # noqa: E402
from contextlib import suppress  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

from meshtrain.components.optimizer import build_optimizer  # noqa: E402
from meshtrain.config import (  # noqa: E402
    LaunchConfig,
    Layout,  # noqa: E402
    TrainingConfig,
)
from meshtrain.distributed.kv_heads import kv_replication_factor  # noqa: E402
from meshtrain.distributed.parallel_dims import ParallelDims  # noqa: E402
from meshtrain.launch.elastic import run_workers  # noqa: E402
from meshtrain.models import build_model, config_from_dict  # noqa: E402
from meshtrain.models.builder import build_model_config, parameter_shapes  # noqa: E402
from meshtrain.models.llama.parallelize import parallelize  # noqa: E402
from meshtrain.models.parallel_model import causal_lm_loss  # noqa: E402
from meshtrain.planner.memory import estimate_model_states  # noqa: E402

SEED = 1234
MIB = 2**20
PHASES = ("fwd", "bwd", "step")  # forward + loss, backward, tp grad sync + optimizer step
KINDS = ("AR", "AG", "RS", "A2A", "other")
ENV_PREFIX = (
    "KEDRO_DISABLE_TELEMETRY=true DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true "
    "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1"
)


# --------------------------------------------------------------------------- collectives


def _collective_kind(name: str) -> str:
    if "all_reduce" in name or "allreduce" in name:
        return "AR"
    if "all_gather" in name or "allgather" in name:
        return "AG"
    if "reduce_scatter" in name:
        return "RS"
    if "all_to_all" in name or "alltoall" in name:
        return "A2A"
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
    """Bytes of the whole tensor a collective works on.

    all-reduce: the reduced tensor; all-gather: the gathered (output) tensor;
    reduce-scatter: the input before scattering; all-to-all: the input.
    Functional collectives (what DTensor issues) receive only the input, so a
    gather's output is the input times the group size; c10d ops (meshtrain's own
    `torch.distributed` calls) receive their output and input buffers.
    """
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
    """CommDebugMode that also records, per collective, its phase, module and tensor bytes.

    CommDebugMode counts the collectives DTensor (and loss_parallel) issue as
    functional collectives, and the c10d ops behind plain `torch.distributed`
    calls; it does not report sizes, so they are taken from the op's tensors.
    """

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.tp = tp
        self.phase = "fwd"
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
        payload = _payload(kind, name, args, group_size)
        module = self.advanced_module_tracker.name if self.phase != "step" else "(step)"
        self.events.append(
            {
                "phase": self.phase,
                "module": module,
                "op": name,
                "kind": kind,
                "group_size": group_size,
                "payload": payload,
                "ring": ring_bytes(kind, payload, group_size),
            }
        )
        return out


# --------------------------------------------------------------------------- per rank


@record
def bench_worker(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Entry point of a spawned rank: measure every sequence-parallel variant of this tp."""
    # Module hooks of the trackers on HF modules (which return dataclasses) warn every step.
    warnings.filterwarnings("ignore", message="For backward hooks to be called")
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("gloo")
    try:
        return [measure(job, sequence_parallel) for sequence_parallel in job["sp_variants"]]
    finally:
        dist.destroy_process_group()


def _batch(step: int, args: dict[str, Any]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + step)  # same tokens on every rank
    return torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=generator)


def measure(job: dict[str, Any], sequence_parallel: bool) -> dict[str, Any]:
    args = job["args"]
    tp = dist.get_world_size()
    device = torch.device("cpu")
    dims = ParallelDims.build(1, tp, 1, device.type)
    config = config_from_dict(job["model_config"])
    layout = Layout(
        data_parallel_size=1,
        tensor_parallel_size=tp,
        pipeline_parallel_size=1,
        pipeline_parallel_num_microbatches=1,
        pipeline_schedule="1f1b",
        sequence_parallel=sequence_parallel and tp > 1,
        zero_1=False,  # the planner turns ZeRO-1 off at dp = 1
        activation_checkpointing="none",
        activation_offloading=False,
    )
    # As the Trainer does it: build, parallelize (tensor/sequence parallel), then the
    # flat buffer and AdamW with the global gradient norm over the tp group. fp32.
    autocast = partial(torch.autocast, device_type=device.type, enabled=False)
    pm = parallelize(build_model(config, seed=SEED), dims, layout, device, autocast)
    pm.set_training(True)
    optimizer = build_optimizer(
        pm, training=TrainingConfig(learning_rate=1e-4, overlap_grad_reduce=False)
    )
    (model,) = pm.modules  # no pipeline parallelism: the one module is the whole model
    kv_replication = kv_replication_factor(config.num_key_value_heads, tp) if tp > 1 else 1

    def update() -> None:
        pm.finish_gradients()
        optimizer.step()
        optimizer.zero_grad()

    def train_step(step: int) -> None:
        pm.train_batch(_batch(step, args), 1)
        update()

    def instrumented_step(step: int, comm: RecordingCommMode) -> None:
        """ParallelModel.train_batch spelled out, to tell forward from backward."""
        input_ids = _batch(step, args)
        comm.phase = "fwd"
        with pm.loss_context():
            with pm.autocast():
                logits = model(input_ids=input_ids).logits
            loss = causal_lm_loss(logits, input_ids)
            del logits
            comm.phase = "bwd"
            loss.backward()
        comm.phase = "step"
        update()

    step = 0
    for _ in range(args["warmup"]):
        train_step(step)
        step += 1

    # Timed steps (information only).
    durations = []
    for _ in range(args["steps"]):
        dist.barrier()
        start = time.perf_counter()
        train_step(step)
        durations.append(time.perf_counter() - start)
        step += 1

    # One step with every collective recorded.
    comm = RecordingCommMode(tp)
    with comm:
        instrumented_step(step, comm)
    step += 1

    # One step with forward + backward under MemTracker (parameters, gradients and AdamW
    # states exist already and are registered as such). The grad sync and optimizer step
    # run outside it: AdamW's temporaries are not activations.
    tracker = MemTracker()
    tracker.track_external(model, optimizer.optimizer)
    input_ids = _batch(step, args)
    with tracker, pm.loss_context():
        with pm.autocast():
            logits = model(input_ids=input_ids).logits
        loss = causal_lm_loss(logits, input_ids)
        del logits
        after_forward = tracker.get_tracker_snapshot("current")
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")
    update()
    del loss
    flat = optimizer.flat
    flat.check_views()  # the parameters and .grad still live in the flat buffers

    element = flat.params.element_size()
    optimizer_state = sum(
        _nbytes(value)
        for state in optimizer.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    replicated_numel = sum(
        flat_slot.numel
        for flat_slot in flat.slots
        if pm.sharding[flat_slot.name].tp_dim is None and tp > 1
    )
    return {
        "tp": tp,
        "sp": sequence_parallel,
        "rank": dist.get_rank(),
        "kv_replication": kv_replication,
        "params_bytes": flat.params.numel() * element,
        "grads_bytes": flat.grads.numel() * element,
        "optimizer_bytes": optimizer_state,
        "local_numel": flat.numel,
        "replicated_numel": replicated_numel,
        "after_forward": _categories(after_forward),
        "peak": _categories(peak),
        "step_times": durations,
        "events": comm.events,
    }


def _categories(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """A MemTracker snapshot of the cpu device as {category name: bytes}."""
    found: dict[str, int] = {}
    for device_snapshot in snapshot.values():
        for key, value in device_snapshot.items():
            name = getattr(key, "value", str(key))
            found[name] = found.get(name, 0) + int(value)
    return found


# --------------------------------------------------------------------------- theory


def theoretical(
    tp: int,
    sp: bool,
    *,
    layers: int,
    batch: int,
    seq: int,
    hidden: int,
    head_dim: int,
    kv_replication: int,
) -> dict[str, Any]:
    """Megatron-style tensor-parallel collectives of one training step, with payloads.

    Per decoder layer: without SP 2 all-reduces forward (after the attention
    and MLP row-parallel projections) and 2 backward (before the fused
    column-parallel q/k/v and gate/up); with SP each becomes a pair: all-gather
    before and reduce-scatter after the block forward, reduce-scatter and
    all-gather backward. Outside the layers:
      * vocab-parallel embedding: fwd AR (SP: RS), bwd none (SP: AG);
      * LM head, column-parallel on the replicated hidden state: fwd none
        (SP: AG of the sequence), bwd AR (SP: RS);
      * loss_parallel cross-entropy: 3 fwd ARs of one value per token (the max
        logit, the sum of exponentials, the target logit), none backward;
      * SP only: the RMSNorm weights (2 per layer + the final norm) see only their
        sequence shard, so their gradients are all-reduced (H values each; Megatron
        does it after the backward, DTensor during it: counted under bwd);
      * meshtrain's optimizer: 1 AR of the squared-gradient sum (a scalar) over tp;
        with KV replication, 1 AR per replicated k/v weight (2 per layer) over the
        ranks holding copies of one KV head (each rank holds one head: head_dim x H).
    Payloads: a hidden-state collective moves B*S*H fp32 values, a loss one B*S.
    """
    counts: dict[str, Counter] = {phase: Counter() for phase in PHASES}
    payload: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    ring: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    if tp == 1:
        return {"counts": counts, "payload": payload, "ring": ring}
    hidden_bytes = batch * seq * hidden * 4
    token_bytes = batch * seq * 4

    def add(phase: str, kind: str, n: int, size: float, group: int = tp) -> None:
        counts[phase][kind] += n
        payload[phase] += n * size
        ring[phase] += n * ring_bytes(kind, size, group)

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
    if kv_replication > 1:
        add("step", "AR", 2 * layers, head_dim * hidden * 4, kv_replication)
    return {"counts": counts, "payload": payload, "ring": ring}


# --------------------------------------------------------------------------- reporting


def _fmt_counts(counter: Counter) -> str:
    parts = [f"{counter[k]} {k}" for k in KINDS if counter.get(k)]
    return " + ".join(parts) if parts else "-"


def _mib(value: float) -> str:
    return f"{value / MIB:.2f}"


def _table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(len(headers)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
            + " |"
        )

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if i in right else "-" * (w + 2) for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _module_kind(name: str) -> str:
    """A module path with the layer index folded: 'LlamaForCausalLM.model.layers.3.mlp' ->
    'layers.*.mlp'; code outside the model's modules (the loss) -> '(outside the model)'."""
    if name.startswith("("):
        return name
    parts = name.split(".")[1:] if "." in name else []
    if parts and parts[0] == "model":
        parts = parts[1:]
    if len(parts) >= 2 and parts[0] == "layers" and parts[1].isdigit():
        parts[1] = "*"
    return ".".join(parts) if parts else "(outside the model)"


def report(results: list[dict[str, Any]], cli: dict[str, Any]) -> None:
    configs: dict[tuple[int, bool], list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        configs[(result["tp"], result["sp"])].append(result)
    order = sorted(configs, key=lambda key: (key[0], key[1]))
    base = configs[(1, False)]
    base_states = max(r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] for r in base)
    base_saved = max(r["after_forward"].get("Activation", 0) for r in base)
    base_peak = max(_transient_peak(r) for r in base)
    base_numel = base[0]["local_numel"]

    print("\nMemory per rank (max over ranks; MiB = 2^20 bytes)")
    memory_rows = []
    for key in order:
        ranks = configs[key]
        tp, sp = key
        states = max(r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] for r in ranks)
        replicated = max(r["replicated_numel"] for r in ranks)
        ideal = 1.0 if tp == 1 else 1 / tp + (1 - 1 / tp) * replicated / base_numel
        estimate = estimate_model_states(
            cli["shapes"],
            dp=1,
            tp=tp,
            pp=1,
            zero_1=False,
            kv_replication=ranks[0]["kv_replication"],
        ).total
        saved = max(r["after_forward"].get("Activation", 0) for r in ranks)
        peak = max(_transient_peak(r) for r in ranks)
        step_time = max(statistics.median(r["step_times"]) for r in ranks)
        memory_rows.append(
            [
                str(tp),
                "yes" if sp else "no",
                _mib(states),
                _mib(estimate),
                f"{states / base_states:.3f}",
                f"{ideal:.3f}",
                _mib(saved),
                f"{saved / base_saved:.3f}",
                _mib(peak),
                f"{peak / base_peak:.3f}",
                f"{step_time:.2f}",
            ]
        )
    print(
        _table(
            [
                "tp",
                "SP",
                "model states MiB",
                "planner est.",
                "ratio",
                "1/tp + repl.",
                "act. saved MiB",
                "ratio",
                "act.+temp peak MiB",
                "ratio",
                "step s",
            ],
            memory_rows,
        )
    )

    print(
        "model states: bytes of the flat parameter and gradient buffers plus the AdamW state\n"
        "  tensors, exact; planner est.: meshtrain.planner.memory.estimate_model_states;\n"
        "  1/tp + repl.: the ratio if all but the replicated norm weights were split 1/tp\n"
        "  (KV-head copies, when --kv-heads < tp, come on top). MemTracker, forward + loss +\n"
        "  backward of one step:\n"
        "  act. saved = 'Activation' bytes alive after forward + loss (kept for backward);\n"
        "  act.+temp peak = peak tracked bytes minus parameters, gradients, optimizer states and\n"
        "  buffers at that moment. step s: median of the timed steps, slowest rank (information)."
    )

    print("\nCollectives per training step, per rank (rank 0; measured | Megatron theory)")
    comm_rows = []
    for key in order:
        tp, sp = key
        rank0 = next(r for r in configs[key] if r["rank"] == 0)
        theory = theoretical(
            tp,
            sp,
            layers=cli["layers"],
            batch=cli["batch"],
            seq=cli["seq"],
            hidden=cli["hidden"],
            head_dim=cli["head_dim"],
            kv_replication=rank0["kv_replication"],
        )
        measured = {phase: Counter() for phase in PHASES}
        payload = dict.fromkeys(PHASES, 0.0)
        sent = 0.0
        for event in rank0["events"]:
            measured[event["phase"]][event["kind"]] += 1
            payload[event["phase"]] += event["payload"]
            sent += event["ring"]
        comm_rows.append(
            [
                str(tp),
                "yes" if sp else "no",
                *(_fmt_counts(measured[phase]) for phase in PHASES),
                *(_fmt_counts(theory["counts"][phase]) for phase in PHASES),
                _mib(sum(payload.values())),
                _mib(sum(theory["payload"].values())),
                _mib(sent),
                _mib(sum(theory["ring"].values())),
            ]
        )
    print(
        _table(
            [
                "tp",
                "SP",
                "fwd",
                "bwd",
                "step",
                "theory fwd",
                "theory bwd",
                "theory step",
                "payload MiB",
                "theory",
                "sent MiB",
                "theory",
            ],
            comm_rows,
            right={0, 8, 9, 10, 11},
        )
    )

    layers = cli["layers"]
    print(
        "AR all-reduce, AG all-gather, RS reduce-scatter. Measured: CommDebugMode on one step\n"
        "  (DTensor and loss_parallel functional collectives, meshtrain's torch.distributed\n"
        "  calls); fwd = forward + loss, bwd = backward, step = tp grad sync + optimizer step.\n"
        f"  Theory, L = {layers} layers: no SP fwd (2L+1) AR [2/layer + embedding] + 3 AR\n"
        "  [loss_parallel: max, sum-exp, target logit], bwd (2L+1) AR [2/layer + LM head];\n"
        "  SP fwd (2L+1) AG + (2L+1) RS + 3 AR, bwd (2L+1) AG + (2L+1) RS + (2L+1) AR\n"
        "  [norm-weight grads, H values each]; step 1 AR [grad-norm scalar] + 2L AR with KV\n"
        "  replication.\n"
        "  payload: bytes of the whole tensor per collective (AR: the tensor, AG: the gathered\n"
        "  output, RS: the input), from the op's tensors; theory: B*S*H fp32 per hidden-state\n"
        "  collective, B*S per loss one. sent: what one rank sends with ring algorithms,\n"
        "  AR 2(n-1)/n x payload, AG and RS (n-1)/n x payload (n = group size)."
    )

    print("\nWhere the measured collectives come from (rank 0, one step; per layer for layers.*)")
    where: dict[tuple[str, str], dict[tuple[int, bool], Counter]] = defaultdict(
        lambda: defaultdict(Counter)
    )
    for key in order:
        if key[0] == 1:
            continue
        rank0 = next(r for r in configs[key] if r["rank"] == 0)
        for event in rank0["events"]:
            where[(_module_kind(event["module"]), event["phase"])][key][event["kind"]] += 1
    tp_keys = [key for key in order if key[0] > 1]
    where_rows = []
    for module, phase in sorted(where, key=lambda mp: (PHASES.index(mp[1]), mp[0])):
        cells = []
        for key in tp_keys:
            counter = where[(module, phase)][key]
            if module.startswith("layers.*"):
                counter = Counter({k: v // cli["layers"] for k, v in counter.items()})
            cells.append(_fmt_counts(counter))
        where_rows.append([phase, module, *cells])
    print(
        _table(
            ["phase", "module", *(f"tp={tp} SP={'yes' if sp else 'no'}" for tp, sp in tp_keys)],
            where_rows,
            right=set(),
        )
    )


def _transient_peak(result: dict[str, Any]) -> int:
    """Peak tracked memory minus the model states present at that moment."""
    peak = result["peak"]
    steady = sum(peak.get(k, 0) for k in ("Parameter", "Buffer", "Gradient", "Optstate"))
    return peak.get("Total", 0) - steady


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=None, help="default 2.75 x hidden")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    intermediate = options.intermediate or int(round(options.hidden * 2.75 / 16)) * 16
    command = (
        f"{ENV_PREFIX} .venv/bin/python bench/tensor_parallel.py "
        f"--hidden {options.hidden} --intermediate {intermediate} --layers {options.layers} "
        f"--heads {options.heads} --kv-heads {options.kv_heads} --vocab {options.vocab} "
        f"--seq {options.seq} --batch {options.batch} --steps {options.steps} "
        f"--warmup {options.warmup} --tp {' '.join(str(t) for t in options.tp)}"
    )
    print(f"reproduce: {command}", flush=True)
    if 1 not in options.tp:
        raise SystemExit("--tp must include 1: the ratios are taken against it")

    model_config = build_model_config(
        "llama",
        {
            "hidden_size": options.hidden,
            "intermediate_size": intermediate,
            "num_hidden_layers": options.layers,
            "num_attention_heads": options.heads,
            "num_key_value_heads": options.kv_heads,
            "max_position_embeddings": max(512, options.seq),
            "rms_norm_eps": 1.0e-5,
            "tie_word_embeddings": False,
        },
        vocab_size=options.vocab,
    )
    numel = sum(p.numel() for p in build_model(model_config, seed=SEED).parameters())
    print(
        f"model: llama, {numel:,} parameters (hidden {options.hidden}, intermediate "
        f"{intermediate}, {options.layers} layers, {options.heads} heads / {options.kv_heads} "
        f"KV heads, vocab {options.vocab}), fp32; batch {options.batch} x {options.seq} tokens; "
        f"{options.warmup} warm-up + {options.steps} timed steps; {os.cpu_count()} CPUs, gloo",
        flush=True,
    )
    cli = {
        "args": {
            "vocab": options.vocab,
            "batch": options.batch,
            "seq": options.seq,
            "steps": options.steps,
            "warmup": options.warmup,
        },
        "model_config": model_config.to_dict(),
    }
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as logs:
        for tp in options.tp:
            job = {**cli, "sp_variants": [False] if tp == 1 else [False, True]}
            start = time.perf_counter()
            by_rank = run_workers(
                bench_worker,
                (job,),
                LaunchConfig(nproc_per_node=tp),
                log_dir=Path(logs) / f"tp{tp}",
                run_id=f"bench-tp{tp}",
            )
            for rank_results in by_rank.values():
                results.extend(rank_results)
            print(f"tp={tp}: group done in {time.perf_counter() - start:.1f}s", flush=True)
    report(
        results,
        {
            "layers": options.layers,
            "batch": options.batch,
            "seq": options.seq,
            "hidden": options.hidden,
            "head_dim": options.hidden // options.heads,
            "shapes": parameter_shapes(model_config),
        },
    )


if __name__ == "__main__":
    main()
