"""Training throughput: meshtrain's real Trainer, HF Trainer and a bare PyTorch loop.

Each side's tokens/s beside the others' in one invocation, and its model FLOP/s beside
the fp32 GEMM rate of the same processes x threads (`bench/machine_limit.py`, read at
the start, before every repeat and at the end), on one Llama shape (`--shape`,
`bench/shapes.py`), the same random blocks, global batch and AdamW settings. meshtrain
sides are `meshtrain.trainer.Trainer` itself, planned as `kedro run` would, its
`train_step`/`log_step` timed per step; `MESHTRAIN_SIDES` each change one setting and
`--control` adds the identical A/A side. `--profile` adds ms per step in each
`meshtrain.*` range of the real step under `torch.profiler`. What each side is and how
it is timed: docs/speed.md, "Training throughput". Nothing is asserted.

    .venv/bin/python bench/throughput.py                          # default shape, ~6-8 min
    .venv/bin/python bench/throughput.py --shape 27m --worlds 1   # one process, ~8 min
    .venv/bin/python bench/throughput.py --profile-only           # only the range tables
"""

from __future__ import annotations

import os

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections import defaultdict  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import datasets  # noqa: E402
import machine_limit  # noqa: E402
import throughput_report  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_runs import (  # noqa: E402  (bench/bench_runs.py)
    ENV_PREFIX,
    RANGES,
    planned_side,
    profiled_steps,
    timed_run,
    token_blocks,
    trainer_group,
    work_root,
)
from shapes import (  # noqa: E402
    LAYOUTS,
    add_shape_arguments,
    apply_shape,
    hf_fields,
    model_flops_per_token,
)
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from meshtrain.components.lr_schedule import warmup_cosine  # noqa: E402
from meshtrain.config import LaunchConfig, RunConfig  # noqa: E402
from meshtrain.launch.elastic import run_workers  # noqa: E402
from meshtrain.models import build_model, build_model_config  # noqa: E402
from meshtrain.trainer import Trainer  # noqa: E402

SEED = 42
# The optimisation settings every side uses (meshtrain's defaults).
OPTIM = {
    "learning_rate": 3e-3,
    "weight_decay": 0.1,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 1.0,
}
# What the launcher sets for a rank; removed for the single-process Trainer.
LAUNCHER_ENV = (
    *("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"),
    *("GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR"),
    *("MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"),
)
# The sides of each world size, in run order (reversed on odd repeats); `world_sides`
# adds the optional ones.
SIDES = {
    2: ("meshtrain", "trainer", "meshtrain_zero1"),
    1: ("meshtrain", "trainer", "bare", "meshtrain_blas"),
}
# meshtrain sides: (parallel.* overrides, training.* overrides) over the default layout.
MESHTRAIN_SIDES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "meshtrain": ({}, {}),
    "meshtrain_again": ({}, {}),
    "meshtrain_zero1": ({"zero_1": True}, {}),
    "meshtrain_zero1_again": ({"zero_1": True}, {}),
    "meshtrain_zero1_gather_after": ({"zero_1": True}, {"overlap_param_gather": False}),
    "meshtrain_after": ({}, {"overlap_grad_reduce": False}),
    "meshtrain_compile": ({}, {"compile": True}),
    "meshtrain_blas": ({}, {"cpu_matmul": "blas"}),
    "meshtrain_onednn": ({}, {"cpu_matmul": "onednn"}),
    **{f"meshtrain_{name}": (parallel, {}) for name, parallel in LAYOUTS.items()},
}
LABELS = {
    "meshtrain": "meshtrain",
    "meshtrain_zero1": "meshtrain, parallel.zero_1=true",
    "meshtrain_zero1_again": "meshtrain, zero_1=true again (control)",
    "meshtrain_zero1_gather_after": "meshtrain, zero_1=true, one all-gather after the update",
    "meshtrain_after": "meshtrain, reduction after backward",
    "meshtrain_tp2": "meshtrain, tp=2 (dp 1)",
    "meshtrain_pp2": "meshtrain, pp=2 (dp 1, 1F1B, 4 microbatches)",
    "meshtrain_compile": "meshtrain, training.compile=true",
    "meshtrain_blas": "meshtrain, training.cpu_matmul=blas (torch.mm)",
    "meshtrain_onednn": "meshtrain, training.cpu_matmul=onednn",
    "meshtrain_again": "meshtrain again (control: identical code)",
    "trainer": "HF Trainer",
    "bare": "bare loop",
}
PROFILE_BLOCK = 4  # steps of one side before the next takes its turn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=RunConfig.from_params().training.grad_bucket_mb,
        help="meshtrain's training.grad_bucket_mb (default: the project's)",
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 1], help="process counts")
    parser.add_argument("--compile", action="store_true", help="+ training.compile=true")
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=[*MESHTRAIN_SIDES, "trainer", "bare"],
        help="run exactly these sides (in this order) at every world size",
    )
    parser.add_argument("--profile", action="store_true", help="add the per-range tables")
    parser.add_argument("--profile-only", action="store_true", help="only the per-range tables")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temp dir")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    args = apply_shape(parser.parse_args(argv))
    layouts = "" if args.layouts == "none" else args.layouts
    args.layouts = [name for name in layouts.split(",") if name]
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    if any(world not in SIDES for world in args.worlds):
        parser.error("--worlds takes 1 and/or 2")
    if args.threads != "auto" and not (args.threads.isdigit() and int(args.threads) > 0):
        parser.error("--threads is a positive integer or auto")
    if any(name not in LAYOUTS for name in args.layouts):
        parser.error(f"--layouts takes {','.join(LAYOUTS)} or none")
    return args


def model_fields(job: dict[str, Any]) -> dict[str, Any]:
    """The Llama config fields of a job's shape (untied LM head)."""
    return {**hf_fields(job), "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def hf_config(job: dict[str, Any]):
    """The same Hugging Face config for every side (sdpa attention, no KV cache)."""
    config = build_model_config("llama", model_fields(job), vocab_size=job["vocab"])
    config.use_cache = False
    return config


def _threads(job: dict[str, Any], ranks: int) -> int:
    """`--threads`, or meshtrain's rule: share this node's cores between its ranks."""
    if job["threads"] == "auto":
        return max(1, (os.cpu_count() or 1) // ranks)
    return int(job["threads"])


def _set_threads(job: dict[str, Any]) -> int:
    threads = _threads(job, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # accelerate would otherwise pick its own
    torch.set_num_threads(threads)
    return threads


def meshtrain_warmup(job: dict[str, Any]) -> int:
    """Untimed steps of a meshtrain side: --warmup, and at least 2: the Trainer measures
    the peak memory of its second step under a dispatch mode (slower, never timed)."""
    return max(job["warmup"], 2)


def _throughput(
    starts: list[float], job: dict[str, Any], tokens_per_step: int, warmup: int
) -> tuple[float, float]:
    """Tokens/s over the `steps` whole steps after `warmup`, from per-step start times:
    (over the whole window, at the median step time)."""
    steps = job["steps"]
    if len(starts) < warmup + steps + 1:
        raise RuntimeError(f"only {len(starts)} step starts recorded")
    window = starts[warmup : warmup + steps + 1]
    durations = [b - a for a, b in zip(window, window[1:], strict=False)]
    return (
        steps * tokens_per_step / (window[-1] - window[0]),
        tokens_per_step / statistics.median(durations),
    )


def meshtrain_spec(job: dict[str, Any], blocks, root: Path, name: str, side: str, steps: int):
    """The worker spec of one meshtrain side, planned as `kedro run` would, for `steps`
    steps. The global batch is `batch x world` at every layout: at tp/pp the dp ranks
    left take it whole."""
    world = job["world"]
    parallel, training = MESHTRAIN_SIDES[side]
    tp = parallel.get("tensor_parallel_size", 1)
    pp = parallel.get("pipeline_parallel_size", 1)
    dp = world // (tp * pp)
    spec, plan = planned_side(
        blocks,
        root,
        name,
        world=world,
        parallel={"data_parallel_size": dp, **parallel},
        training={
            **OPTIM,
            "per_device_train_batch_size": job["batch"] * world // dp,
            "max_steps": steps,
            "warmup_steps": job["warmup"],
            "seed": SEED,
            "log_every": 1,
            "grad_bucket_mb": job["bucket_mb"],
            "mixed_precision": job.get("mixed_precision", "no"),
            **training,
        },
        shape=model_fields(job),
        vocab=job["vocab"],
        block=job["block"],
        cuda=job.get("device") == "cuda",
    )
    layout = plan.layout
    sizes = (layout.data_parallel_size, layout.tensor_parallel_size, layout.pipeline_parallel_size)
    assert sizes == (dp, tp, pp), (layout.name, side)
    assert plan.global_batch_size == job["batch"] * world, plan.global_batch_size
    return spec


@record
def meshtrain_entry(spec: Any, job: dict[str, Any]) -> dict[str, Any] | None:
    """The real Trainer in this rank, every step timed from its start (rank 0 returns the
    start times and the Trainer's summary)."""
    threads = None if job["threads"] == "auto" else _set_threads(job)
    with trainer_group(spec, threads):
        starts, summary = timed_run(Trainer(spec))
    if summary is None:
        return None
    return {"starts": starts, "threads": torch.get_num_threads(), "summary": summary}


def _collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([f["input_ids"] for f in features], dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def _training_arguments(job: dict[str, Any]):
    """The HF Trainer's arguments: ours where both have the setting, its defaults else."""
    from transformers import TrainingArguments  # noqa: PLC0415

    return TrainingArguments(
        output_dir=job["out"],
        per_device_train_batch_size=job["batch"],
        max_steps=job["warmup"] + job["steps"] + 1,
        **OPTIM,
        lr_scheduler_type="cosine",
        warmup_steps=job["warmup"],
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_drop_last=True,
        ddp_backend="gloo" if job["world"] > 1 else None,
        use_cpu=True,
        seed=SEED,
    )


@record
def trainer_entry(job: dict[str, Any]) -> dict[str, Any] | None:
    """Build and run a Hugging Face Trainer: on a launched rank (accelerate reads the
    torch elastic env: DDP over gloo), or plainly in this process (no DDP)."""
    import transformers  # noqa: PLC0415
    from transformers import Trainer as HFTrainer  # noqa: PLC0415
    from transformers import TrainerCallback  # noqa: PLC0415

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    threads = _set_threads(job)
    if job["world"] == 1:  # a plain single process, as `python train.py` runs it
        for key in LAUNCHER_ENV:
            os.environ.pop(key, None)
    starts: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            starts.append(time.perf_counter())

    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(job), dtype=torch.float32)
    trainer = HFTrainer(
        model=model,
        args=_training_arguments(job),
        train_dataset=datasets.load_from_disk(job["blocks"])["train"],
        data_collator=_collate,
        callbacks=[StepTimes()],
    )
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        output = trainer.train()  # (PrinterCallback prints a dict per step)
    if trainer.args.process_index != 0:
        return None
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    return {
        "starts": starts,
        "threads": threads,
        "optimizer": f"{type(optimizer).__name__} ({trainer.args.optim})",
        "layout": f"{str(trainer.args.parallel_mode).rsplit('.', 1)[-1]}, "
        f"{type(trainer.model_wrapped).__name__}",
        "train_runtime": output.metrics["train_runtime"],
    }


@record
def bare_entry(job: dict[str, Any]) -> dict[str, Any]:
    """One process, no process group: HF model, torch AdamW, clip_grad_norm_ (on the
    job's device, under bf16 autocast where its `mixed_precision` is bf16)."""
    import transformers  # noqa: PLC0415

    threads = _set_threads(job)
    device = torch.device(job.get("device", "cpu"))
    bf16 = job.get("mixed_precision", "no") == "bf16"
    torch.manual_seed(SEED)
    config = hf_config(job)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(device).train()
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.ndim >= 2]},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=OPTIM["learning_rate"],
        betas=(OPTIM["adam_beta1"], OPTIM["adam_beta2"]),
        eps=OPTIM["adam_epsilon"],
        weight_decay=OPTIM["weight_decay"],
    )
    total = job["warmup"] + job["steps"] + 1
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        partial(warmup_cosine, warmup_steps=job["warmup"], max_steps=total, min_ratio=0.1),
    )
    train = datasets.load_from_disk(job["blocks"])["train"].with_format("torch")
    blocks = train[:]["input_ids"].long().to(device)  # preloaded: the loop reads no files
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(SEED))
    starts = []
    for step in range(total):
        starts.append(time.perf_counter())
        ids = blocks[order[(torch.arange(job["batch"]) + step * job["batch"]) % len(blocks)]]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids).logits
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, config.vocab_size).float(), ids[:, 1:].reshape(-1)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["max_grad_norm"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        loss.item()
    return {"starts": starts, "threads": threads, "layout": "1 process, no group"}


@contextlib.contextmanager
def _quiet(log: Path, verbose: bool):
    """Send the ranks' teed output (and the launcher's warnings) to a log file."""
    if verbose:
        yield
        return
    with open(log, "a") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        yield


def _launch(entry, job: dict[str, Any], arguments: tuple, root: Path, tag: str, verbose: bool):
    """Rank 0's result of `entry(*arguments)` in a fresh group of `job["world"]` ranks."""
    with _quiet(root / "ranks.log", verbose):
        results = run_workers(
            entry,
            arguments,
            LaunchConfig(nproc_per_node=job["world"]),
            log_dir=root / "runs" / tag / "logs",
            run_id=tag,
        )
    for path in (root / "runs" / tag).iterdir():  # what a run wrote but its logs
        if path.name != "logs":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return results[0]


def run_one(side: str, job: dict[str, Any], blocks, root: Path, tag: str, verbose: bool):
    """One run of one side; prints a line and returns rank 0's result with tokens/s and
    the layout that ran."""
    tokens_per_step = job["batch"] * job["world"] * job["block"]
    began = time.perf_counter()
    extra = ""
    if side.startswith("meshtrain"):
        warmup = meshtrain_warmup(job)
        spec = meshtrain_spec(job, blocks, root, tag, side, warmup + job["steps"] + 1)
        result = _launch(meshtrain_entry, job, (spec, job), root, tag, verbose)
        summary = result["summary"]
        result["layout"] = summary["layout_name"]
        buckets = summary["gradient_buckets"]
        extra = (
            f"; own mean_tokens_per_s {summary['mean_tokens_per_s']:,.0f}; "
            f"{buckets['started_in_backward']} of {buckets['count']} gradient buckets "
            "started in the backward"
        )
    else:
        warmup = job["warmup"]
        entry = trainer_entry if side == "trainer" else bare_entry
        result = _launch(
            entry, job, ({**job, "out": str(root / "runs" / tag)},), root, tag, verbose
        )
        if side == "trainer":
            whole = (warmup + job["steps"] + 1) * tokens_per_step / result["train_runtime"]
            extra = f"; whole run from train_runtime {whole:,.0f}; {result['optimizer']}"
    result["tokens_per_s"], result["median_tokens_per_s"] = _throughput(
        result["starts"], job, tokens_per_step, warmup
    )
    print(
        f"  {tag:<20} {result['tokens_per_s']:>8,.0f} tokens/s (median step "
        f"{result['median_tokens_per_s']:,.0f}; {result['layout']}; {result['threads']} "
        f"thread(s)/process, {time.perf_counter() - began:.0f}s with start-up{extra})",
        flush=True,
    )
    return result


def world_sides(world: int, args: argparse.Namespace) -> tuple[str, ...]:
    """The sides run at `world` processes, in run order."""
    if args.sides:
        return tuple(args.sides)
    sides = SIDES[world]
    if world == 2:
        sides += ("meshtrain_after",) if args.after else ()
        sides += tuple(f"meshtrain_{name}" for name in args.layouts)
    sides += ("meshtrain_compile",) if args.compile else ()
    return sides + (("meshtrain_again",) if args.control else ())


def _job(args: argparse.Namespace, world: int, blocks_path: Path) -> dict[str, Any]:
    job = {**vars(args), "world": world, "blocks": str(blocks_path), "work_dir": None}
    job.pop("worlds")
    return job


def run_world(
    world: int, args: argparse.Namespace, root: Path, blocks_path: Path, limits: list[dict]
) -> dict[str, dict[str, list]]:
    """Every side of `world`, `--repeats` times, the order reversed on odd repeats: per
    side, its tokens/s, tokens/s at the median step, and layout, one per repeat. Before
    each repeat the GEMM rate of this world's processes x threads is read into `limits`."""
    blocks = datasets.load_from_disk(str(blocks_path))
    job = _job(args, world, blocks_path)
    sides = world_sides(world, args)
    runs: dict[str, dict[str, list]] = {side: defaultdict(list) for side in sides}
    for repeat in range(args.repeats):
        order = sides if repeat % 2 == 0 else tuple(reversed(sides))
        limits.append(machine_limit.measure([(world, _threads(job, world))]))
        print("\n".join(machine_limit.describe(limits[-1])), flush=True)
        print(f"world {world}, repeat {repeat + 1}: {' -> '.join(order)}", flush=True)
        for side in order:
            result = run_one(
                side, job, blocks, root, f"w{world}-r{repeat + 1}-{side}", args.verbose
            )
            for key in ("tokens_per_s", "median_tokens_per_s", "layout"):
                runs[side][key].append(result[key])
    return runs


def throughput_tables(args: argparse.Namespace, root: Path, blocks_path: Path, flops: int):
    """The machine's GEMM rate, every world's sides, the GEMM rate again; the tables."""
    arrangements = {world: (world, _threads(vars(args), world)) for world in args.worlds}
    every = sorted(set(arrangements.values()))
    print(f"machine limit, start: fp32 GEMM at {every}", flush=True)
    limits = [machine_limit.measure(every)]
    print("\n".join(machine_limit.describe(limits[0])), flush=True)
    runs = {world: run_world(world, args, root, blocks_path, limits) for world in args.worlds}
    limits.append(machine_limit.measure(every))
    print("machine limit, end\n" + "\n".join(machine_limit.describe(limits[-1])), flush=True)
    return throughput_report.report(args, runs, limits, arrangements, flops, LABELS)


@record
def profile_entry(specs: dict[str, Any], job: dict[str, Any]) -> dict[str, Any] | None:
    """Every side's real Trainer in this one group, profiled in turns; rank 0's times."""
    warnings.filterwarnings("ignore")
    threads = None if job["threads"] == "auto" else _set_threads(job)
    with trainer_group(next(iter(specs.values())), threads):
        trainers = {side: Trainer(spec) for side, spec in specs.items()}
        walls, ranges = profiled_steps(trainers, job["profile_warmup"], job["steps"], PROFILE_BLOCK)
        if torch.distributed.get_rank() != 0:
            return None
        layouts = {side: trainer.layout.name for side, trainer in trainers.items()}
    return {"walls": walls, "ranges": ranges, "layouts": layouts, "threads": threads}


def profile_lines(world: int, result: dict[str, Any], steps: int, tokens: int) -> list[str]:
    """ms per step in each range, the rest of the step, the step; tokens/s and ratios."""
    names, walls, ranges = list(result["walls"]), result["walls"], result["ranges"]
    layouts = result["layouts"]
    rest = {n: walls[n] - sum(v for k, v in ranges[n].items() if k != "gather") for n in names}
    lines = [
        "",
        f"profile, {world} process(es): the real Trainer's step under torch.profiler, ms per "
        f"step on rank 0, mean of {steps} steps per column, columns taking turns in blocks "
        f"of {PROFILE_BLOCK} steps; gather runs inside forward",
        f"| range | {' | '.join(f'{LABELS[n]} ({layouts[n]})' for n in names)} |",
        "|---|" + "---:|" * len(names),
    ]
    rows = [(f"meshtrain.{r}", {n: ranges[n].get(r) for n in names}, "{:.1f}") for r in RANGES]
    rows += [
        ("rest (data, logging, LR)", rest, "{:.1f}"),
        ("**step (wall)**", walls, "**{:.1f}**"),
    ]
    for label, seconds, form in rows:
        if any(value is not None for value in seconds.values()):
            cells = [
                form.format(1000 * v / steps) if v is not None else "-" for v in seconds.values()
            ]
            lines.append(f"| {label} | {' | '.join(cells)} |")
    speed = " | ".join(f"{steps * tokens / walls[n]:,.0f}" for n in names)
    ratio = " | ".join(f"{walls[n] / walls[names[0]]:.3f}x" for n in names)
    return [*lines, f"| tokens/s | {speed} |", f"| {names[0]} over this column | {ratio} |"]


def profile_tables(args: argparse.Namespace, root: Path, blocks_path: Path) -> list[str]:
    """Per world, the range table of its meshtrain sides, in one process group."""
    blocks = datasets.load_from_disk(str(blocks_path))
    lines: list[str] = []
    for world in args.worlds:
        job = _job(args, world, blocks_path)
        job["profile_warmup"] = max(meshtrain_warmup(job), 3)  # past the probes' steps
        total = job["profile_warmup"] + job["steps"] + 1
        sides = [s for s in world_sides(world, args) if s.startswith("meshtrain")]
        specs = {
            side: meshtrain_spec(job, blocks, root, f"profile-w{world}-{side}", side, total)
            for side in sides
        }
        print(f"profile, world {world}: {', '.join(sides)}", flush=True)
        tag = f"profile-w{world}"
        result = _launch(profile_entry, job, (specs, job), root, tag, args.verbose)
        lines += profile_lines(world, result, job["steps"], args.batch * world * args.block)
    return lines


def main() -> None:
    args = parse_args()
    with contextlib.ExitStack() as stack:
        root = work_root(stack, args.work_dir, "mt-bench-")
        (root / "runs").mkdir(exist_ok=True)
        num_train = max(1024, (args.warmup + args.steps + 3) * args.batch * max(args.worlds) * 2)
        token_blocks(root / "blocks", num_train + 4, args.vocab, args.block, learnable=False)
        config = build_model_config("llama", model_fields(vars(args)), vocab_size=args.vocab)
        parameters = sum(p.numel() for p in build_model(config, seed=SEED).parameters())
        flops = model_flops_per_token(config, args.block)
        header = (
            f"Llama (--shape {args.shape}): hidden {args.hidden}, intermediate "
            f"{args.intermediate}, {args.layers} layers, {args.heads} heads, {args.kv_heads} KV "
            f"heads, vocab {args.vocab} ({parameters:,} parameters; {flops / 1e6:,.1f} MFLOPs "
            f"per token); blocks of {args.block}, per-device batch {args.batch}; "
            f"{os.cpu_count()} CPUs; torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M')}"
        )
        print(header, flush=True)
        lines: list[str] = []
        if not args.profile_only:
            lines += throughput_tables(args, root, root / "blocks", flops)
        if args.profile or args.profile_only:
            lines += profile_tables(args, root, root / "blocks")
        print(f"\ncommand: {ENV_PREFIX} .venv/bin/python {' '.join(sys.argv)}")
        print("\n".join([header, *lines]))


if __name__ == "__main__":
    main()
