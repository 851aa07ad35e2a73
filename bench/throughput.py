"""Training throughput: meshtrain, HF Trainer and a bare PyTorch loop, against the GEMM rate.

Each side's tokens/s beside the others', and its model FLOP/s beside the fp32 GEMM rate
of the same processes x threads on this machine.

One invocation trains one Llama shape, `--shape` (each flag such as `--hidden` still
overrides it; presets in `bench/shapes.py`):

* `default`: the project's, hidden 128, intermediate 352, 4 layers, 4 heads, 2 KV heads,
  vocabulary 4096, blocks of 128, per-device batch 8 (1.8M parameters);
* `27m`: hidden 512, intermediate 1344, 8 layers, 8 heads, 4 KV heads, vocabulary 4096,
  blocks of 256, per-device batch 4 (27.0M parameters);
* `110m`: hidden 768, intermediate 3072, 12 layers, 12 heads, 4 KV heads, vocabulary
  4096, blocks of 512, per-device batch 2 (110.1M parameters),

on the same random token blocks (saved with `datasets`, read back memory-mapped), with
the same global batch (per-device batch x world), AdamW hyper-parameters (lr 3e-3,
betas 0.9/0.95, eps 1e-8, weight decay 0.1 off norms), `max_grad_norm=1.0`, fp32, and
the same number of steps, as

(a) meshtrain: `make_worker_spec` + `run_workers(worker_main_sequence, ...)`, the real
    loop (`meshtrain.trainer.Trainer`), as the planner lays the run out (`meshtrain`;
    whether ZeRO-1 is on is the planner's call, and each run prints its layout's name),
    logging every step (`log_every=1`: a loss all-reduce and `.item()` per step),
    `eval_batches=0`, `checkpoint_every` beyond the run (the final step still saves one,
    untimed, deleted after the run). At world 2 also with `parallel.zero_1=true`
    (`meshtrain_zero1`); with `--layouts` (on at 27m and 110m) at tp=2 (`meshtrain_tp2`)
    and pp=2 with 1F1B over 4 microbatches (`meshtrain_pp2`), dp 1, the one rank's
    per-device batch the whole global batch; with `--after` (on at the default shape)
    with the bucketed reductions after the backward (`training.overlap_grad_reduce=false`).
    `--sides` runs exactly the sides named, e.g. ZeRO-1 with its parameter gather
    overlapped with the next forward (the default), with one all-gather after the update
    (`meshtrain_zero1_gather_after`) and again (`meshtrain_zero1_again`, the control).
    `--compile` adds `training.compile=true`; `--control` (on at 27m and 110m) runs
    `meshtrain` once more, identical code: its ratio to `meshtrain` (A/A) is the noise.
    In one process also with `training.cpu_matmul=blas` (`meshtrain_blas`): its Linear
    layers on `torch.mm` as the other sides', where the default (`auto`) routes them to
    oneDNN on this CPU (`models/cpu_linear.py`), to show what that choice buys;
(b) Hugging Face `Trainer` (transformers + accelerate), everything else at its defaults,
    launched with `run_workers` and an entry point that builds the `Trainer`: at dp=2
    accelerate reads the torch elastic env (DDP over gloo, `find_unused_parameters=True`
    as the Trainer sets it for a model without gradient checkpointing); in one process
    the entry point first drops the launcher's distributed variables, so it runs as
    `python train.py` would. `eval_strategy="no"`, `save_strategy="no"`, `report_to=[]`,
    this release's default optimizer (`adamw_torch_fused`), cosine schedule with the
    same warm-up, `dataloader_num_workers=0`, `logging_steps=1` (the loss and grad norm
    to the host every step too);
(c) in one process only, launched the same way: a bare loop with no process group,
    `AutoModelForCausalLM.from_config`, torch AdamW (its defaults), `clip_grad_norm_`,
    the blocks preloaded into one tensor, `.item()` of the loss every step.

World 2 compares (a) with (b); one process compares (a), (b) and (c). Every run is a
fresh process (group) started by `run_workers`. Every process runs `--threads`
intra-op threads: 1 at the default shape (on a shared 2-core machine `auto` swings
step times 10x whenever a thread is descheduled), `auto` at 27m and 110m
(`os.cpu_count() // ranks`, meshtrain's own rule: the whole machine per side, as a
user would run it).

Timing, identical for all sides: each run trains `warmup + steps + 1` steps and
records the wall clock at the *start* of every step (meshtrain: the loop's sampler is
swapped, in the worker only, for a subclass that notes the time when `train` asks it
for the step's samples, first thing in a step -- `src/` is not changed; Trainer:
`TrainerCallback.on_step_begin`; bare loop: the loop itself). Throughput = `steps *
tokens per step / (start[warmup + steps] - start[warmup])`: whole steps with everything
a loop does between them (data, logging, host syncs, callbacks), without start-up,
warm-up, the last step and what follows it. meshtrain's warm-up is at least 2 steps:
its second step measures peak memory under a dispatch mode and is never timed. Every
preset's `--warmup` is 2, so that the other sides skip as many steps (with `--warmup 1`
at 110M they timed their second step and meshtrain did not, a bias in its favour).
Each run also prints meshtrain's own `mean_tokens_per_s` and the Trainer's whole-run
rate from `train_runtime`. Each configuration runs `--repeats` times, the order of the
sides reversed on every other repeat; only ratios measured side by side mean anything
on a shared machine.

The machine's limit (`bench/machine_limit.py`): the faster of fp32 `torch.mm` and
oneDNN's product, n = 1024 and 2048, in P concurrent processes of T threads, for each
(processes, threads) a side runs, at the start of the invocation, before each repeat
of its world (the rate moves by up to a fifth within minutes here) and at the end;
their mean is the base of "MFU vs GEMM".
Model FLOPs per token (issue #19), as training runs count them for their `mfu`: 6 x
the matmul weights (the untied LM head counts, the input embedding not) + 12 x layers
x hidden x block length. The tables give per side
its layout, tokens/s per repeat, mean and at the median step time, model GFLOP/s (mean
tokens/s x FLOPs per token) and that over the GEMM rate; then meshtrain's ratio to each
other side (mean, per repeat, at the median step) with the A/A beside it; then the
targets: meshtrain / HF Trainer at dp=2 >= 1.05 (1.10 at the default shape), meshtrain
/ bare loop in one process >= 1.05 (0.97 at the default shape), meshtrain's one-process
MFU vs GEMM >= 0.85. Nothing is asserted.

`--profile` adds where a step's time goes, per phase: a copy of the loop of
`meshtrain.trainer.Trainer` (same components: `parallelize`, `FlatParameters`, the
pieces of `ShardedAdamW.reduce_gradients` and `apply`, `BlockStore`,
`GlobalBatchSampler`) with timers around data, forward, loss, backward, gradient
reduction, norm and clipping, AdamW, parameter all-gather, zero_grad and the logging
sync; at dp > 1 also with the reduction after the backward, and with `zero_1` off;
and the same timers around what the Trainer runs underneath (DDP, `clip_grad_norm_`,
fused AdamW, `zero_grad(set_to_none=True)`); in one process also the bare loop's step
(torch AdamW at its defaults); with `--compile` the meshtrain copy with its decoder
layers compiled, with `--control` the meshtrain copy twice (the A/A). All columns run in
one process group, warmed up, in alternating blocks of a few steps: far less noisy than
separate runs, since every column sees the same moments of the machine.

Rough durations on the 2-core machine when it is quiet (estimated from short runs;
two to three times longer with other jobs on it):

    .venv/bin/python bench/throughput.py                  # default shape, ~6-8 min
    .venv/bin/python bench/throughput.py --shape 27m      # ~25-30 min (30 runs)
    .venv/bin/python bench/throughput.py --shape 110m     # ~1 h (30 runs)
    .venv/bin/python bench/throughput.py --shape 27m --worlds 1   # one process, ~8 min
    .venv/bin/python bench/throughput.py --profile-only   # only the per-phase tables
    .venv/bin/python bench/throughput.py --compile        # + meshtrain with torch.compile
    .venv/bin/python bench/machine_limit.py               # the GEMM rate alone, ~15 s
"""

from __future__ import annotations

import os

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import itertools  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
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
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_runs import plan_on_blocks  # noqa: E402  (bench/bench_runs.py)
from shapes import (  # noqa: E402
    LAYOUTS,
    add_run_arguments,
    add_shape_arguments,
    apply_shape,
    model_flops_per_token,
)
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from meshtrain.components.lr_schedule import warmup_cosine  # noqa: E402
from meshtrain.config import LaunchConfig, RunConfig  # noqa: E402
from meshtrain.data.blocks import BlockStore, arrow_files  # noqa: E402
from meshtrain.data.sampler import GlobalBatchSampler  # noqa: E402
from meshtrain.launch.elastic import run_workers  # noqa: E402
from meshtrain.models import build_model, build_model_config  # noqa: E402

SEED = 42
DATA_SEED = 0
ENV_PREFIX = (
    "KEDRO_DISABLE_TELEMETRY=true DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true "
    "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false"
)
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
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)
# The sides of each world size, in run order (reversed on odd repeats); `world_sides`
# adds the optional ones. At dp=2, meshtrain with the planner's default layout, with
# ZeRO-1 forced on, and (at the default shape) with its bucketed gradient reduction
# after the backward instead of during it, to show what overlap buys.
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
    **{f"meshtrain_{name}": (parallel, {}) for name, parallel in LAYOUTS.items()},
}
LABELS = {
    "meshtrain": "meshtrain",
    "meshtrain_zero1": "meshtrain, parallel.zero_1=true",
    "meshtrain_zero1_again": "meshtrain, parallel.zero_1=true again (control)",
    "meshtrain_zero1_gather_after": "meshtrain, zero_1=true, one all-gather after the update",
    "meshtrain_after": "meshtrain, reduction after backward",
    "meshtrain_tp2": "meshtrain, tp=2 (dp 1)",
    "meshtrain_pp2": "meshtrain, pp=2 (dp 1, 1F1B, 4 microbatches)",
    "meshtrain_compile": "meshtrain, training.compile=true",
    "meshtrain_blas": "meshtrain, training.cpu_matmul=blas (torch.mm, as the others)",
    "meshtrain_again": "meshtrain again (control: identical code)",
    "trainer": "HF Trainer",
    "bare": "bare loop",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=RunConfig.from_params().training.grad_bucket_mb,
        help="meshtrain's training.grad_bucket_mb (default: the project's)",
    )
    parser.add_argument(
        "--worlds", type=int, nargs="+", default=[2, 1], help="process counts to compare"
    )
    add_run_arguments(parser)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="add a meshtrain side with training.compile=true (compiled during the warm-up)",
    )
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=[*MESHTRAIN_SIDES, "trainer", "bare"],
        help="run exactly these sides (in this order) at every world size, e.g. "
        "meshtrain_zero1 meshtrain_zero1_gather_after meshtrain_zero1_again",
    )
    parser.add_argument("--profile", action="store_true", help="add the per-phase breakdown")
    parser.add_argument("--profile-only", action="store_true", help="only the per-phase breakdown")
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


def model_fields(args: argparse.Namespace | dict[str, Any]) -> dict[str, Any]:
    a = vars(args) if isinstance(args, argparse.Namespace) else args
    return {
        "hidden_size": a["hidden"],
        "intermediate_size": a["intermediate"],
        "num_hidden_layers": a["layers"],
        "num_attention_heads": a["heads"],
        "num_key_value_heads": a["kv_heads"],
        "max_position_embeddings": max(512, a["block"]),
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }


def hf_config(job: dict[str, Any]):
    """The same Hugging Face config for every side (sdpa attention, no KV cache)."""
    config = build_model_config("llama", model_fields(job), vocab_size=job["vocab"])
    config.use_cache = False
    return config


def make_blocks(root: Path, args: argparse.Namespace, num_train: int) -> Path:
    """Random token blocks saved with `datasets` (memory-mapped when loaded back)."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    ids = torch.randint(0, args.vocab, (num_train + 64, args.block), generator=generator)
    ids = ids.to(torch.int32)
    features = datasets.Features(
        {"input_ids": datasets.List(datasets.Value("int32"), length=args.block)}
    )
    blocks = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(
                {"input_ids": ids[:num_train].numpy()}, features=features
            ),
            "validation": datasets.Dataset.from_dict(
                {"input_ids": ids[num_train:].numpy()}, features=features
            ),
        }
    )
    path = root / "blocks"
    blocks.save_to_disk(str(path))
    return path


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


# meshtrain measures the peak memory of its second step (index 1) under a dispatch mode
# that follows every storage: slower, and never timed. Its sides skip it whatever --warmup.
MESHTRAIN_PROBE_STEP = 1


def meshtrain_warmup(job: dict[str, Any]) -> int:
    """Untimed steps of a meshtrain side: --warmup, and at least up to the probed step."""
    return max(job["warmup"], MESHTRAIN_PROBE_STEP + 1)


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


# --------------------------------------------------------------------------- (a) meshtrain


class _TimedSampler(GlobalBatchSampler):
    """The loop's sampler, noting the wall clock when each step asks for its samples.

    `train` calls `rank_microbatches` first thing in every step, right after its own
    `step_start = time.perf_counter()`, so these are the step start times.
    """

    starts: list[float] = []
    threads = 0
    set_threads: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.set_threads:  # train() builds this right before its loop
            torch.set_num_threads(self.set_threads)
        type(self).starts = []
        type(self).threads = torch.get_num_threads()

    def rank_microbatches(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        type(self).starts.append(time.perf_counter())
        return super().rank_microbatches(*args, **kwargs)


@record
def meshtrain_entry(specs: list[Any], job: dict[str, Any]) -> dict[str, Any] | None:
    """`worker_main_sequence` with the step start times recorded (rank 0 returns them)."""
    import meshtrain.launch.worker
    import meshtrain.trainer

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    _TimedSampler.set_threads = None if job["threads"] == "auto" else _threads(job, local_world)
    meshtrain.trainer.GlobalBatchSampler = _TimedSampler  # this worker process only
    summaries = meshtrain.launch.worker.worker_main_sequence(specs)
    if summaries[-1] is None:
        return None
    return {
        "starts": list(_TimedSampler.starts),
        "threads": _TimedSampler.threads,
        "summary": summaries[-1],
    }


def meshtrain_spec(
    job: dict[str, Any], blocks: datasets.DatasetDict, out: Path, name: str, side: str = "meshtrain"
):
    """The worker spec of one meshtrain side, planned as `kedro run` would. The global
    batch is `batch x world` at every layout: at tp/pp the dp ranks left take it whole."""
    from meshtrain.launch.job import make_worker_spec

    world = job["world"]
    parallel, training = MESHTRAIN_SIDES[side]
    tp = parallel.get("tensor_parallel_size", 1)
    pp = parallel.get("pipeline_parallel_size", 1)
    dp = world // (tp * pp)
    run = RunConfig.from_params(
        parallel={"data_parallel_size": dp, **parallel},
        training={
            **OPTIM,
            "per_device_train_batch_size": job["batch"] * world // dp,
            "max_steps": meshtrain_warmup(job) + job["steps"] + 1,
            "warmup_steps": job["warmup"],
            "seed": SEED,
            "log_every": 1,
            "eval_batches": 0,
            "eval_every": 10**9,
            "checkpoint_every": 10**9,
            "keep_last": 1,
            "output_dir": str(out),
            "run_name": name,
            "grad_bucket_mb": job["bucket_mb"],
            "mixed_precision": job.get("mixed_precision", "no"),
            **training,
        },
        launch={"nproc_per_node": world},
        model={"architecture": "llama", "config": model_fields(job)},
        data={"block_size": job["block"], "vocab_size": job["vocab"]},
    )
    config = build_model_config("llama", model_fields(job), vocab_size=job["vocab"])
    plan = plan_on_blocks(run, config, blocks, cuda=job.get("device") == "cuda")
    assert plan.global_batch_size == job["batch"] * world, plan.global_batch_size
    layout = plan.layout
    sizes = (layout.data_parallel_size, layout.tensor_parallel_size, layout.pipeline_parallel_size)
    assert sizes == (dp, tp, pp), (layout.name, side)
    spec = make_worker_spec(
        run,
        plan,
        train_files=arrow_files(blocks["train"]),
        validation_files=arrow_files(blocks["validation"]),
        tokenizer_dir=None,
    )
    return spec, run.launch


# --------------------------------------------------------------------------- (b) Trainer


def _collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([f["input_ids"] for f in features], dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


@record
def trainer_entry(job: dict[str, Any]) -> dict[str, Any] | None:
    """Build and run a Hugging Face Trainer: on a launched rank (accelerate reads the
    torch elastic env: DDP over gloo), or plainly in this process (no DDP)."""
    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    threads = _set_threads(job)
    if job["world"] == 1:  # a plain single process, as `python train.py` runs it
        for key in LAUNCHER_ENV:
            os.environ.pop(key, None)

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.threads = 0
            self.world = 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.threads = torch.get_num_threads()
            self.world = args.world_size

        def on_step_begin(self, args, state, control, **kwargs):
            self.starts.append(time.perf_counter())

    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(job), dtype=torch.float32)
    train = datasets.load_from_disk(job["blocks"])["train"]
    arguments = TrainingArguments(
        output_dir=job["out"],
        per_device_train_batch_size=job["batch"],
        gradient_accumulation_steps=1,
        max_steps=job["warmup"] + job["steps"] + 1,
        learning_rate=OPTIM["learning_rate"],
        weight_decay=OPTIM["weight_decay"],
        adam_beta1=OPTIM["adam_beta1"],
        adam_beta2=OPTIM["adam_beta2"],
        adam_epsilon=OPTIM["adam_epsilon"],
        max_grad_norm=OPTIM["max_grad_norm"],
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
        bf16=False,
        fp16=False,
    )
    timer = StepTimes()
    trainer = Trainer(
        model=model,
        args=arguments,
        train_dataset=train,
        data_collator=_collate,
        callbacks=[timer],
    )
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        output = trainer.train()  # (PrinterCallback prints a dict per step)
    if trainer.args.process_index != 0:
        return None
    return {
        "starts": timer.starts,
        "threads": timer.threads or threads,
        "world": timer.world,
        "optim": str(trainer.args.optim),
        "optimizer": type(trainer.optimizer.optimizer).__name__
        if hasattr(trainer.optimizer, "optimizer")
        else type(trainer.optimizer).__name__,
        "wrapped": type(trainer.model_wrapped).__name__,
        "parallel_mode": str(trainer.args.parallel_mode).rsplit(".", 1)[-1],
        "train_runtime": output.metrics["train_runtime"],
        "loss": output.training_loss,
    }


# --------------------------------------------------------------------------- (c) bare loop


@record
def bare_entry(job: dict[str, Any]) -> dict[str, Any]:
    """One process, no process group: HF model, torch AdamW, clip_grad_norm_ (on the
    job's device, under bf16 autocast where its `mixed_precision` is bf16)."""
    import transformers

    threads = _set_threads(job)
    device = torch.device(job.get("device", "cpu"))
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=job.get("mixed_precision", "no") == "bf16"
    )
    torch.manual_seed(SEED)
    config = hf_config(job)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(device).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": OPTIM["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=OPTIM["learning_rate"],
        betas=(OPTIM["adam_beta1"], OPTIM["adam_beta2"]),
        eps=OPTIM["adam_epsilon"],
    )
    total = job["warmup"] + job["steps"] + 1
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        partial(warmup_cosine, warmup_steps=job["warmup"], max_steps=total, min_ratio=0.1),
    )
    train = datasets.load_from_disk(job["blocks"])["train"].with_format("torch")
    blocks = train[:]["input_ids"].long().to(device)  # preloaded: the loop reads no files
    batch = job["batch"]
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(SEED))
    vocab = config.vocab_size
    starts, losses = [], []
    for step in range(total):
        starts.append(time.perf_counter())
        index = order[(torch.arange(batch) + step * batch) % len(blocks)]
        ids = blocks[index.to(device)]
        with autocast:
            logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["max_grad_norm"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"starts": starts, "threads": threads, "loss": losses[-1]}


# --------------------------------------------------------------------------- driver


@contextlib.contextmanager
def _quiet(log: Path, verbose: bool):
    """Send the ranks' teed output (and the launcher's warnings) to a log file."""
    if verbose:
        yield
        return
    with (
        open(log, "a") as handle,
        contextlib.redirect_stdout(handle),
        contextlib.redirect_stderr(handle),
    ):
        yield


def run_one(system: str, job: dict[str, Any], blocks, root: Path, tag: str, verbose: bool):
    """One run of one side; prints a line and returns rank 0's result with tokens/s and
    the layout that ran."""
    world = job["world"]
    out = root / "runs"
    tokens_per_step = job["batch"] * world * job["block"]
    began = time.perf_counter()
    with _quiet(root / "ranks.log", verbose):
        if system.startswith("meshtrain"):
            spec, launch = meshtrain_spec(job, blocks, out, tag, system)
            results = run_workers(
                meshtrain_entry, ([spec], job), launch, log_dir=out / tag / "logs", run_id=tag
            )
        else:
            entry = trainer_entry if system == "trainer" else bare_entry
            results = run_workers(
                entry,
                ({**job, "out": str(out / tag)},),
                LaunchConfig(nproc_per_node=world),
                log_dir=out / tag / "logs",
                run_id=tag,
            )
    result = results[0]
    _drop_outputs(out / tag)
    warmup = meshtrain_warmup(job) if system.startswith("meshtrain") else job["warmup"]
    result["tokens_per_s"], result["median_tokens_per_s"] = _throughput(
        result["starts"], job, tokens_per_step, warmup
    )
    result["wall_s"] = time.perf_counter() - began
    result["layout"], extra = _describe_run(system, result, job, tokens_per_step)
    print(
        f"  {tag:<20} {result['tokens_per_s']:>8,.0f} tokens/s (median step "
        f"{result['median_tokens_per_s']:,.0f}; {result['layout']}; "
        f"{result['threads']} thread(s)/process, {result['wall_s']:.0f}s with start-up"
        f"{extra})",
        flush=True,
    )
    return result


def _drop_outputs(run_dir: Path) -> None:
    """Delete what a run wrote but its logs (meshtrain's final checkpoint: 1.3 GB at
    110M parameters, once per run)."""
    for path in run_dir.iterdir() if run_dir.is_dir() else ():
        if path.name != "logs":
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _describe_run(
    system: str, result: dict[str, Any], job: dict[str, Any], tokens_per_step: int
) -> tuple[str, str]:
    """The layout that ran, and what else the run line says about it."""
    if system.startswith("meshtrain"):
        summary = result["summary"]
        buckets = summary["gradient_buckets"]
        return summary["layout_name"], (
            f"; own mean_tokens_per_s {summary['mean_tokens_per_s']:,.0f}; "
            f"{buckets['started_in_backward']} of {buckets['count']} gradient buckets "
            "started in the backward"
        )
    if system == "trainer":
        whole = (job["warmup"] + job["steps"] + 1) * tokens_per_step / result["train_runtime"]
        layout = f"{result['parallel_mode']}, {result['wrapped']}"
        return layout, (
            f"; whole run from train_runtime {whole:,.0f}; "
            f"{result['optimizer']} ({result['optim']})"
        )
    return "1 process, no group", ""


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


def run_world(
    world: int,
    args: argparse.Namespace,
    root: Path,
    blocks_path: Path,
    arrangement: tuple[int, int],
    limits: list[dict],
) -> dict[str, dict[str, list]]:
    """Every side of `world`, `--repeats` times, the order reversed on odd repeats: per
    side, its tokens/s, tokens/s at the median step, and layout, one per repeat. Before
    each repeat the GEMM rate of its `arrangement` is read into `limits`."""
    blocks = datasets.load_from_disk(str(blocks_path))
    job = {**vars(args), "world": world, "blocks": str(blocks_path), "work_dir": None}
    job.pop("worlds")
    sides = world_sides(world, args)
    runs: dict[str, dict[str, list]] = {side: defaultdict(list) for side in sides}
    for repeat in range(args.repeats):
        order = sides if repeat % 2 == 0 else tuple(reversed(sides))
        limits.append(machine_limit.measure([arrangement]))
        print("\n".join(machine_limit.describe(limits[-1])), flush=True)
        print(f"world {world}, repeat {repeat + 1}: {' -> '.join(order)}", flush=True)
        for side in order:
            tag = f"w{world}-r{repeat + 1}-{side}"
            result = run_one(side, job, blocks, root, tag, args.verbose)
            for key in ("tokens_per_s", "median_tokens_per_s", "layout"):
                runs[side][key].append(result[key])
    return runs


def throughput_tables(
    args: argparse.Namespace, root: Path, blocks_path: Path, flops_per_token: int
) -> list[str]:
    """The machine's GEMM rate, every world's sides, the GEMM rate again; the tables."""
    arrangements = {world: (world, _threads(vars(args), world)) for world in args.worlds}
    print(f"machine limit, start: fp32 GEMM at {sorted(set(arrangements.values()))}", flush=True)
    limits = [machine_limit.measure(sorted(set(arrangements.values())))]
    print("\n".join(machine_limit.describe(limits[0])), flush=True)
    runs = {
        world: run_world(world, args, root, blocks_path, arrangements[world], limits)
        for world in args.worlds
    }
    print("machine limit, end", flush=True)
    limits.append(machine_limit.measure(sorted(set(arrangements.values()))))
    print("\n".join(machine_limit.describe(limits[-1])), flush=True)
    return throughput_report.report(args, runs, limits, arrangements, flops_per_token, LABELS)


# --------------------------------------------------------------------------- --profile

PHASES = (
    "data",
    "forward",
    "loss",
    "backward",
    "grad reduce",
    "grad norm+clip",
    "adamw",
    "param gather",
    "zero_grad+lr",
    "log sync",
)


PROFILE_BLOCK = 4  # steps of one side before switching to the other
PROFILE_LABELS = {
    "meshtrain": "meshtrain (as is)",
    "after backward": "meshtrain, reduction after backward",
    "zero_1 flipped": "meshtrain, zero_1 the other way",
    "ddp": "DDP + fused AdamW (Trainer's step)",
    "compiled": "meshtrain, training.compile=true",
    "again": "meshtrain again (control)",
    "bare": "bare loop's step (torch AdamW defaults)",
}


class _Timer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.last = time.perf_counter()

    def restart(self) -> None:
        self.last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.totals[name] += now - self.last
        self.last = now


def _meshtrain_copy(job: dict[str, Any], dims, blocks: BlockStore, variant: str = "as is"):
    """The set-up of `meshtrain.trainer.Trainer`, and a step function timing each phase.

    variant "as is": what `train` runs (the bucketed reductions started during the
    backward, so "backward" includes starting them and "grad reduce" is what is left
    to wait for). "after backward": the same with `training.overlap_grad_reduce=false`.
    "zero_1 flipped": ZeRO-1 the other way from the plan's layout (on where the planner
    left it off: reductions to the owners and the all-gather after the update).
    """
    from meshtrain.components.metrics import rss_mb as _rss_mb
    from meshtrain.distributed.flat_buffer import FlatParameters
    from meshtrain.distributed.zero import ShardedAdamW
    from meshtrain.models import config_from_dict
    from meshtrain.models.cpu_linear import cpu_matmul_choice
    from meshtrain.models.llama.parallelize import parallelize
    from meshtrain.models.parallel_model import causal_lm_loss
    from meshtrain.planner import Plan

    plan = Plan.from_dict(job["plan"])
    layout = plan.layout
    model = build_model(config_from_dict(plan.model_config), seed=SEED)
    autocast = partial(torch.autocast, device_type="cpu", dtype=torch.bfloat16, enabled=False)
    compiled = variant == "compiled"
    cpu = torch.device("cpu")
    setting = RunConfig.from_params().training.cpu_matmul
    onednn = cpu_matmul_choice(setting, cpu, tensor_parallel=dims.tp > 1) == "onednn"
    pm = parallelize(
        model, dims, layout, cpu, autocast, compile_layers=compiled, onednn_linears=onednn
    )
    pm.set_training(True)
    flat = FlatParameters(pm.parameters.items(), num_shards=dims.dp, sharding=pm.sharding)
    optimizer = ShardedAdamW(
        flat,
        dims.dp_group,
        zero_1=layout.zero_1 != (variant == "zero_1 flipped"),
        lr=OPTIM["learning_rate"],
        betas=(OPTIM["adam_beta1"], OPTIM["adam_beta2"]),
        eps=OPTIM["adam_epsilon"],
        weight_decay=OPTIM["weight_decay"],
        max_grad_norm=OPTIM["max_grad_norm"],
        overlap_reduction=variant != "after backward",
        bucket_bytes=int(job["bucket_mb"] * 2**20),
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer,
        partial(warmup_cosine, warmup_steps=job["warmup"], max_steps=10**6, min_ratio=0.1),
    )
    sampler = GlobalBatchSampler(len(blocks), job["batch"] * dims.dp, SEED)

    def step(index: int, timer: _Timer) -> None:
        timer.restart()
        micro = sampler.rank_microbatches(index, dims.dp_rank, dims.dp, job["batch"])
        optimizer.reducer.expect(len(micro))
        loss_sum = torch.zeros(())
        for indices in micro:
            ids = blocks.batch(indices)
            timer.mark("data")
            with pm.autocast():
                logits = pm.modules[0](input_ids=ids).logits
            timer.mark("forward")
            loss = causal_lm_loss(logits, ids) / len(micro)
            timer.mark("loss")
            loss.backward()
            loss_sum += loss.detach()
            timer.mark("backward")
        optimizer.reducer.finish(optimizer.grad_shard)
        timer.mark("grad reduce")
        norm = optimizer.global_grad_norm()
        coef = torch.clamp(optimizer.max_grad_norm / (norm + 1e-6), max=1.0)
        optimizer.grad_shard.mul_(coef)
        timer.mark("grad norm+clip")
        optimizer.optimizer.step()
        timer.mark("adamw")
        if optimizer.zero_1 and dims.dp > 1:
            owned = flat.params[optimizer.start : optimizer.end]
            dist.all_gather_single(flat.params, owned, group=optimizer.group)
        timer.mark("param gather")
        schedule.step()
        flat.zero_grad()
        timer.mark("zero_grad+lr")
        dist.all_reduce(loss_sum, group=dims.dp_group)
        float(norm), loss_sum.item(), _rss_mb()
        timer.mark("log sync")

    return step


def _ddp_copy(job: dict[str, Any], dims, blocks: BlockStore, fused: bool = True):
    """What the Trainer runs underneath: DDP (bucketed all-reduce overlapping the
    backward), `clip_grad_norm_`, fused torch AdamW, `zero_grad(set_to_none=True)`; with
    `fused` False, torch AdamW at its defaults, as the bare loop runs it."""
    import transformers
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(SEED)
    config = hf_config(job)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    # As the Trainer wraps a model without gradient checkpointing.
    wrapped = DistributedDataParallel(model, find_unused_parameters=True) if dims.dp > 1 else model
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": OPTIM["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=OPTIM["learning_rate"],
        betas=(OPTIM["adam_beta1"], OPTIM["adam_beta2"]),
        eps=OPTIM["adam_epsilon"],
        fused=fused or None,
    )
    sampler = GlobalBatchSampler(len(blocks), job["batch"] * dims.dp, SEED)

    def step(index: int, timer: _Timer) -> None:
        timer.restart()
        (indices,) = sampler.rank_microbatches(index, dims.dp_rank, dims.dp, job["batch"])
        ids = blocks.batch(indices)
        timer.mark("data")
        logits = wrapped(input_ids=ids).logits
        timer.mark("forward")
        loss = model.loss_function(logits, ids, vocab_size=config.vocab_size)
        timer.mark("loss")
        loss.backward()
        timer.mark("backward")  # includes DDP's overlapped all-reduce
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["max_grad_norm"])
        timer.mark("grad norm+clip")
        optimizer.step()
        timer.mark("adamw")
        optimizer.zero_grad(set_to_none=True)
        timer.mark("zero_grad+lr")
        detached = loss.detach().clone()
        if dims.dp > 1:
            dist.all_reduce(detached)
        float(norm), detached.item()
        timer.mark("log sync")

    return step


@record
def profile_entry(job: dict[str, Any]) -> dict[str, Any] | None:
    """Both copies in one process group, alternating blocks of steps; rank 0's timings."""
    from meshtrain.distributed.parallel_dims import ParallelDims

    warnings.filterwarnings("ignore")
    threads = _set_threads(job)
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        dims = ParallelDims.build(world, 1, 1, "cpu")
        blocks = BlockStore(job["train_files"])
        steps = {"meshtrain": _meshtrain_copy(job, dims, blocks)}
        if world > 1:
            steps["after backward"] = _meshtrain_copy(job, dims, blocks, "after backward")
            steps["zero_1 flipped"] = _meshtrain_copy(job, dims, blocks, "zero_1 flipped")
        if job["compile"]:
            steps["compiled"] = _meshtrain_copy(job, dims, blocks, "compiled")
        if job["control"]:
            steps["again"] = _meshtrain_copy(job, dims, blocks)
        steps["ddp"] = _ddp_copy(job, dims, blocks)
        if world == 1:
            steps["bare"] = _ddp_copy(job, dims, blocks, fused=False)
        timers = {name: _Timer() for name in steps}
        walls: dict[str, float] = defaultdict(float)
        for step in steps.values():  # warm-up, untimed
            for index in range(job["warmup"]):
                step(index, _Timer())
        done = dict.fromkeys(steps, job["warmup"])
        total = job["warmup"] + 2 * job["steps"]
        for repeat in itertools.count():  # blocks of PROFILE_BLOCK steps, order alternating
            if all(count >= total for count in done.values()):
                break
            order = list(steps) if repeat % 2 == 0 else list(reversed(steps))
            order = order[repeat % len(order) :] + order[: repeat % len(order)]
            for name in order:
                dist.barrier()
                began = time.perf_counter()
                for index in range(done[name], min(total, done[name] + PROFILE_BLOCK)):
                    steps[name](index, timers[name])
                done[name] = min(total, done[name] + PROFILE_BLOCK)
                walls[name] += time.perf_counter() - began
        if dist.get_rank() != 0:
            return None
        return {
            "threads": threads,
            "steps": 2 * job["steps"],
            "phases": {name: dict(timer.totals) for name, timer in timers.items()},
            "walls": dict(walls),
        }
    finally:
        dist.destroy_process_group()


def profile_tables(args: argparse.Namespace, root: Path, blocks_path: Path) -> list[str]:
    blocks = datasets.load_from_disk(str(blocks_path))
    lines: list[str] = []
    for world in args.worlds:
        job = {**vars(args), "world": world, "blocks": str(blocks_path), "work_dir": None}
        job.pop("worlds")
        spec, launch = meshtrain_spec(job, blocks, root / "runs", f"profile-w{world}-plan")
        job["plan"] = spec.plan
        job["train_files"] = spec.train_files
        tag = f"profile-w{world}"
        print(f"profile, world {world}", flush=True)
        with _quiet(root / "ranks.log", args.verbose):
            results = run_workers(
                profile_entry,
                (job,),
                LaunchConfig(nproc_per_node=world),
                log_dir=root / "runs" / tag / "logs",
                run_id=tag,
            )
        result = results[0]
        n = result["steps"]
        tokens = args.batch * world * args.block
        layout = f"dp={world}" if world > 1 else "1 process"
        zero = f" (meshtrain: {job['plan']['layout_name']})" if world > 1 else ""
        names = list(result["walls"])
        lines.append("")
        lines.append(
            f"profile, {layout}{zero}: ms per step on rank 0, mean of {n} steps per column "
            f"({result['threads']} thread(s)/rank), columns in alternating blocks of "
            f"{PROFILE_BLOCK} steps"
        )
        lines.append(f"| phase | {' | '.join(PROFILE_LABELS[name] for name in names)} |")
        lines.append("|---|" + "---:|" * len(names))
        for phase in PHASES:
            cells = []
            for name in names:
                phases = result["phases"][name]
                cells.append(f"{1000 * phases[phase] / n:.1f}" if phase in phases else "-")
            if any(cell != "-" for cell in cells):
                lines.append(f"| {phase} | {' | '.join(cells)} |")
        walls = result["walls"]
        lines.append(
            "| **step (wall)** | "
            + " | ".join(f"**{1000 * walls[name] / n:.1f}**" for name in names)
            + " |"
        )
        rates = [f"{n * tokens / walls[name]:,.0f}" for name in names]
        lines.append(f"| tokens/s | {' | '.join(rates)} |")
        lines.append(
            "| vs DDP copy | "
            + " | ".join(f"{walls['ddp'] / walls[name]:.3f}x" for name in names)
            + " |"
        )
        lines.append(
            "| meshtrain over this column | "
            + " | ".join(f"{walls[name] / walls['meshtrain']:.3f}x" for name in names)
            + " |"
        )
    return lines


def work_root(stack: contextlib.ExitStack, work_dir: Path | None, prefix: str) -> Path:
    """`--work-dir`, created if missing, or a temporary directory `stack` removes."""
    if work_dir is None:
        return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
    work_dir.mkdir(parents=True, exist_ok=True)
    return work_dir


def main() -> None:
    args = parse_args()
    with contextlib.ExitStack() as stack:
        root = work_root(stack, args.work_dir, "mt-bench-")
        total_steps = args.warmup + args.steps + 1
        num_train = max(1024, total_steps * args.batch * max(args.worlds) * 2)
        blocks_path = make_blocks(root, args, num_train)
        config = build_model_config("llama", model_fields(args), vocab_size=args.vocab)
        model = build_model(config, seed=SEED)
        parameters = sum(p.numel() for p in model.parameters())
        flops = model_flops_per_token(config, args.block)
        del model
        header = [
            f"Llama (--shape {args.shape}): hidden {args.hidden}, intermediate "
            f"{args.intermediate}, {args.layers} layers, {args.heads} heads, {args.kv_heads} KV "
            f"heads, vocab {args.vocab} ({parameters:,} parameters; {flops / 1e6:,.1f} MFLOPs "
            f"per token); blocks of {args.block}, per-device batch {args.batch}; "
            f"{os.cpu_count()} CPUs; torch {torch.__version__}",
        ]
        print(header[0], flush=True)
        lines: list[str] = []
        if not args.profile_only:
            lines += throughput_tables(args, root, blocks_path, flops)
        if args.profile or args.profile_only:
            lines += profile_tables(args, root, blocks_path)
        print()
        print(f"command: {ENV_PREFIX} .venv/bin/python {' '.join(sys.argv)}")
        print("\n".join(header + lines))


if __name__ == "__main__":
    main()
