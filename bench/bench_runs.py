"""What the benchmarks share: model flags, token blocks, a planned worker spec for one
side, running it in its own spawned group, the real `Trainer` driven step by step in a
rank (timed, or under `torch.profiler`), a gloo ping-pong, the memory table.

Every meshtrain side is `meshtrain.trainer.Trainer`, built from the spec `kedro run`
would make; nothing here copies its set-up or its step. Imported by the scripts beside
it; not a benchmark itself.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from shapes import SHAPES, hf_fields  # noqa: E402  (bench/shapes.py)

from meshtrain.config import LaunchConfig, RunConfig  # noqa: E402
from meshtrain.data.blocks import arrow_files  # noqa: E402
from meshtrain.launch.elastic import run_workers  # noqa: E402
from meshtrain.launch.job import make_worker_spec  # noqa: E402
from meshtrain.launch.worker import worker_main_sequence  # noqa: E402
from meshtrain.models import build_model_config  # noqa: E402
from meshtrain.planner import Plan, plan_run  # noqa: E402
from meshtrain.trainer import Trainer, WorkerSpec  # noqa: E402

# The 27M-parameter Llama of the speed issue (#19).
SHAPE_27M = hf_fields(SHAPES["27m"])
MIB = 2**20
# The ranges the real step carries (models/parallel_model.py, trainer.py,
# distributed/param_gather.py); `gather` runs inside `forward` (its waits are hooks).
RANGES = ("forward", "backward", "pipeline", "reduce", "optimizer", "gather")
ENV_PREFIX = (
    "KEDRO_DISABLE_TELEMETRY=true DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true "
    "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false"
)
MODEL_FLAGS = ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "seq", "batch")


def add_model_arguments(parser: argparse.ArgumentParser, *defaults: int | None) -> None:
    """`--hidden ... --batch` (MODEL_FLAGS, in order) with these defaults."""
    for name, default in zip(MODEL_FLAGS, defaults, strict=True):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def llama_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The Llama config fields of MODEL_FLAGS (untied LM head; intermediate ~8/3 hidden
    when not given)."""
    return {
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate or round(args.hidden * 8 / 3 / 64) * 64,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": max(512, args.seq),
        "tie_word_embeddings": False,
    }


def token_blocks(
    out: Path, count: int, vocab: int, block: int, *, learnable: bool = True, validation: int = 4
):
    """`count` blocks saved with `datasets` and memory-mapped back, the last `validation`
    of them the validation split: arithmetic sequences mod the vocabulary (so losses move), or
    uniform random tokens (`learnable=False`, the throughput benches')."""
    import datasets  # noqa: PLC0415

    datasets.disable_progress_bars()
    generator = torch.Generator().manual_seed(0)
    if learnable:
        start = torch.randint(0, vocab, (count, 1), generator=generator)
        stride = torch.randint(1, 8, (count, 1), generator=generator)
        ids = ((start + stride * torch.arange(block)) % vocab).int()
    else:
        ids = torch.randint(0, vocab, (count, block), generator=generator).int()
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"), block)})
    blocks = datasets.DatasetDict(
        {
            name: datasets.Dataset.from_dict({"input_ids": part.numpy()}, features=features)
            for name, part in (("train", ids[:-validation]), ("validation", ids[-validation:]))
        }
    )
    blocks.save_to_disk(str(out))
    return datasets.load_from_disk(str(out))


def planned_side(
    blocks,
    root: Path,
    name: str,
    *,
    world: int,
    parallel: dict[str, Any],
    training: dict[str, Any],
    shape: dict[str, Any],
    vocab: int,
    block: int,
    init_from: str | None = None,
    cuda: bool = False,
    lora: dict[str, Any] | None = None,
    planner: dict[str, Any] | None = None,
    architecture: str = "llama",
) -> tuple[WorkerSpec, Plan]:
    """The worker spec and plan of one side, as `kedro run` would make them (no
    validation, no checkpoint but the last unless `training` says otherwise; `lora`: the
    side's `model.lora`; `planner`: its `planner.*`; `architecture`: `model.architecture`)."""
    run = RunConfig.from_params(
        parallel=parallel,
        training={
            "warmup_steps": 1,
            "learning_rate": 1e-3,
            "eval_batches": 0,
            "checkpoint_every": 10_000,
            "keep_last": 1,
            **training,
            "output_dir": str(root / "runs"),
            "run_name": name,
        },
        launch={"nproc_per_node": world},
        model={
            "architecture": architecture,
            "config": shape,
            "init_from": init_from,
            "lora": lora,
        },
        data={"block_size": block, "vocab_size": vocab},
        planner=planner or {},
    )
    config = build_model_config(architecture, shape, vocab_size=vocab, init_from=init_from)
    plan = plan_on_blocks(run, config, blocks, cuda=cuda)
    spec = make_worker_spec(
        run, plan, train_files=arrow_files(blocks["train"]), validation_files=[], tokenizer_dir=None
    )
    return spec, plan


def plan_on_blocks(run: RunConfig, config: Any, blocks: Any, cuda: bool = False) -> Plan:
    """The plan of `run` for `config` on these token blocks, for CPU unless `cuda`."""
    return plan_run(
        run,
        config,
        num_train_blocks=len(blocks["train"]),
        num_validation_blocks=len(blocks["validation"]),
        cuda_available=cuda,
    )


def run_side(spec: WorkerSpec, world: int, root: Path, name: str) -> dict[str, Any]:
    """Train one side with meshtrain's own worker in its own group of `world` spawned
    ranks; rank 0's summary."""
    print(f"== {name}", flush=True)
    (summary,) = run_workers(
        worker_main_sequence,
        ([spec],),
        LaunchConfig(nproc_per_node=world),
        log_dir=root / "logs" / name,
        run_id=name,
    )[0]
    return summary


@contextlib.contextmanager
def trainer_group(spec: WorkerSpec, threads: int | None = None) -> Iterator[None]:
    """Join the process group as meshtrain's worker does (its device, its share of the
    cores unless `threads` says otherwise), and leave it."""
    plan = Plan.from_dict(spec.plan)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if plan.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world))
    timeout = RunConfig.from_dict(spec.run).launch.collective_timeout_s
    dist.init_process_group(plan.backend, timeout=timedelta(seconds=timeout))
    try:
        yield
    finally:
        dist.destroy_process_group()


def step_and_log(trainer: Trainer, step: int) -> None:
    """One step of the real Trainer with its logging (the loss sync), as `train` runs it."""
    outcome = trainer.train_step(step)
    done = step + 1
    if done % trainer.cfg.log_every == 0 or done == trainer.cfg.max_steps:
        trainer.log_step(done, outcome)


def timed_run(trainer: Trainer) -> tuple[list[float], dict[str, Any] | None]:
    """All the Trainer's steps, noting the wall clock at the start of each (and after the
    last); rank 0's summary as `train` would return it (no validation, no checkpoint)."""
    starts = []
    for step in range(trainer.start_step, trainer.cfg.max_steps):
        starts.append(time.perf_counter())
        step_and_log(trainer, step)
    starts.append(time.perf_counter())
    trainer.optimizer.wait_for_parameters()
    peaks = trainer.gather_peak_memory()
    if dist.get_rank() != 0:
        return starts, None
    return starts, {**trainer.summary(None, None, starts[-1] - starts[0]), **peaks}


def profiled_steps(trainers: dict[str, Trainer], warmup: int, steps: int, block: int = 4):
    """Each Trainer's steps under `torch.profiler`, the trainers taking turns in blocks of
    `block` steps (the order alternating), after `warmup` untimed steps each: per
    trainer, the wall seconds of its profiled steps and the seconds in each range."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    walls: dict[str, float] = defaultdict(float)
    ranges: dict[str, dict[str, float]] = {name: defaultdict(float) for name in trainers}
    for trainer in trainers.values():
        for step in range(warmup - 1):
            step_and_log(trainer, step)
        with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own start-up
            step_and_log(trainer, warmup - 1)
    done = dict.fromkeys(trainers, warmup)
    for turn in range(-(-steps // block)):
        order = list(trainers) if turn % 2 == 0 else list(reversed(trainers))
        for name in order:
            count = min(block, warmup + steps - done[name])
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                began = time.perf_counter()
                for step in range(done[name], done[name] + count):
                    step_and_log(trainers[name], step)
                walls[name] += time.perf_counter() - began
            done[name] += count
            for event in prof.key_averages():
                if event.key.startswith("meshtrain."):
                    ranges[name][event.key.removeprefix("meshtrain.")] += event.cpu_time_total / 1e6
    for trainer in trainers.values():
        trainer.optimizer.wait_for_parameters()
    return dict(walls), {name: dict(seconds) for name, seconds in ranges.items()}


def one_way_send_s(shape: tuple[int, ...], rounds: int = 20) -> float | None:
    """Median one-way seconds (half a ping-pong) of a tensor of `shape` between ranks 0
    and 1 with plain gloo send/recv, as a pipeline stage boundary sends. Collective; rank
    0 gets the time, the others None."""
    rank, buffer, times = dist.get_rank(), torch.randn(shape), []
    dist.barrier()
    for _ in range(3 + rounds):
        start = time.perf_counter()
        if rank in (0, 1):
            peer = 1 - rank
            (dist.send, dist.recv)[rank](buffer, peer)
            (dist.recv, dist.send)[rank](buffer, peer)
        times.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(times[3:]) / 2 if rank == 0 else None


def work_root(stack: contextlib.ExitStack, work_dir: Path | None, prefix: str) -> Path:
    """`--work-dir`, created if missing, or a temporary directory `stack` removes."""
    if work_dir is None:
        return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
    work_dir.mkdir(parents=True, exist_ok=True)
    return work_dir


def print_side_table(rows: list[tuple[str, dict[str, Any], Plan]]) -> dict[str, tuple]:
    """One line per side: model states (counted from the tensors), the step's peak of live
    tensors and the peak resident set over the ranks, each beside the planner's figure;
    the start-up RSS, tokens/s beside the planner's (its estimate for the plan's device),
    the last loss. Returns per side (model states, step peak,
    run RSS, tokens/s), for the ratios."""
    print(
        f"\n{'side':<18}{'model states MiB':>17}{'planner':>9}{'step peak MiB':>14}"
        f"{'planner':>9}{'start RSS':>10}{'RSS MiB':>9}{'planner':>9}{'tokens/s':>10}"
        f"{'planner':>9}{'last loss':>11}"
    )
    table = {}
    for name, summary, plan in rows:
        memory = plan.memory_estimate_per_rank
        predicted = memory["parameters"] + memory["gradients"] + memory["optimizer_states"]
        peak = summary["measured_peak_memory"] or {}
        rss = max(summary["peak_rss_mb_per_rank"])
        states, speed = summary["model_states_bytes_rank0"], summary["mean_tokens_per_s"]
        table[name] = (states, peak.get("peak_bytes"), rss, speed)
        cells = [
            (states, 17, MIB, ".1f"),
            (predicted, 9, MIB, ".1f"),
            (peak.get("peak_bytes"), 14, MIB, ".1f"),
            (peak.get("predicted_peak_bytes"), 9, MIB, ".1f"),
            (max(summary["startup_peak_rss_mb_per_rank"]), 10, 1, ".0f"),
            (rss, 9, 1, ".0f"),
            (memory["process_total"], 9, MIB, ".0f"),
            (speed, 10, 1, ".0f"),
            (plan.time_estimate.get("tokens_per_s"), 9, 1, ".0f"),
            (summary["final_loss"], 11, 1, ".4f"),
        ]
        text = "".join(
            f"{'-' if v is None else format(v / unit, ',' + form):>{width}}"
            for v, width, unit, form in cells
        )
        print(f"{name:<18}{text}")
    print()
    return table
