"""The per-rank training loop: set up groups, build the model, wrap it, loop.

`worker_main` is what the launcher starts on every rank; `train` is the loop
itself and also runs inside a process group someone else made (tests).
"""

from __future__ import annotations

import os
import resource
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from meshtrain.checkpoint.load import restore_checkpoint
from meshtrain.checkpoint.save import save_checkpoint
from meshtrain.config import RunConfig
from meshtrain.data.blocks import BlockStore
from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.memory_probe import PeakMemory, measure_peak_memory
from meshtrain.models import build_model, config_from_dict
from meshtrain.parallel.mesh import ParallelDims
from meshtrain.parallel.pipeline_parallel import idle_fraction, theoretical_bubble
from meshtrain.parallelize import ParallelModel, build_optimizer, parallelize
from meshtrain.planner import Plan
from meshtrain.plots import pipeline_timeline
from meshtrain.schedule import warmup_cosine
from meshtrain.tracking import MetricsLogger, TrackingTarget


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs, as plain JSON-able values (it crosses a process spawn)."""

    run: dict[str, Any]
    plan: dict[str, Any]
    train_files: list[str]
    validation_files: list[str]
    run_dir: str
    tokenizer_dir: str | None = None
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    resume_from: str | None = None  # a complete checkpoint folder


@record
def worker_main(spec: WorkerSpec) -> dict[str, Any] | None:
    """Entry point of a launched rank: join the group, train, leave the group."""
    return worker_main_sequence([spec])[0]


@record
def worker_main_sequence(specs: list[WorkerSpec]) -> list[dict[str, Any] | None]:
    """Train several specs one after the other in one process group.

    Process start-up (importing torch and transformers, the rendezvous) costs
    more than a small run, so sweeps over options of one world size and the
    equivalence tests share one group.
    """
    plan = Plan.from_dict(specs[0].plan)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if plan.backend == "nccl":
        torch.cuda.set_device(local_rank)
    else:
        # Share the cores between the ranks of this node instead of oversubscribing them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(plan.backend, timeout=timedelta(minutes=10))
    try:
        return [train(spec) for spec in specs]
    finally:
        dist.destroy_process_group()


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MiB."""
    with open("/proc/self/statm") as handle:
        resident_pages = int(handle.read().split()[1])
    current = resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return current, peak


def train(spec: WorkerSpec) -> dict[str, Any] | None:
    """Train for `training.max_steps` steps; rank 0 returns a summary, other ranks None."""
    run = RunConfig.from_dict(spec.run)
    plan = Plan.from_dict(spec.plan)
    layout, cfg = plan.layout, run.training
    # The planner's split of the batch (it differs from the parameter when
    # training.global_batch_size is set); plans older than that field lack it.
    per_device = plan.per_device_train_batch_size or cfg.per_device_train_batch_size
    rank = dist.get_rank()
    device = torch.device(
        f"cuda:{torch.cuda.current_device()}" if plan.backend == "nccl" else "cpu"
    )

    dims = ParallelDims.build(
        layout.data_parallel_size,
        layout.tensor_parallel_size,
        layout.pipeline_parallel_size,
        device.type,
    )
    model_config = config_from_dict(plan.model_config)
    model = build_model(model_config, seed=cfg.seed, init_from=run.model.init_from).to(device)
    autocast = partial(
        torch.autocast,
        device_type=device.type,
        dtype=torch.bfloat16,
        enabled=cfg.mixed_precision == "bf16",
    )
    pm = parallelize(model, dims, layout, device, autocast, compile_layers=cfg.compile)
    del model  # only this rank's stages are kept
    pm.set_training(True)

    flat, optimizer = build_optimizer(
        pm, zero_1=layout.zero_1, overlap=cfg.overlap_grad_reduce, training=cfg
    )
    start_step = 0
    if spec.resume_from:
        resumed = restore_checkpoint(
            Path(spec.resume_from),
            parameters=pm.parameters,
            layouts=pm.layouts,
            flat=flat,
            optimizer=optimizer,
            dims=dims,
        )
        start_step = resumed["step"]
        for group in optimizer.optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer.optimizer,
        partial(
            warmup_cosine,
            warmup_steps=cfg.warmup_steps,
            max_steps=cfg.max_steps,
            min_ratio=cfg.min_learning_rate_ratio,
        ),
        last_epoch=start_step - 1,
    )

    train_blocks = BlockStore(spec.train_files)
    validation_blocks = BlockStore(spec.validation_files) if spec.validation_files else None
    sampler = GlobalBatchSampler(len(train_blocks), plan.global_batch_size, cfg.seed)
    tracker = MetricsLogger(
        TrackingTarget(spec.tracking_uri, spec.mlflow_run_id)
        if rank == 0 and spec.mlflow_run_id
        else None
    )
    run_dir = Path(spec.run_dir)
    state_bytes = (
        flat.params.numel() + flat.grads.numel() + 2 * optimizer.owned_numel
    ) * flat.params.element_size()

    def evaluate() -> float | None:
        if validation_blocks is None or cfg.eval_batches == 0:
            return None
        return evaluate_loss(
            pm, validation_blocks, cfg.eval_batches, device, per_device, plan.global_batch_size
        )

    def checkpoint(step: int) -> Path:
        return save_checkpoint(
            run_dir,
            step,
            parameters=pm.parameters,
            layouts=pm.layouts,
            optimizer=optimizer,
            dims=dims,
            trainer_state={
                "step": step,
                "layout": layout.to_dict(),
                "layout_name": layout.name,
                "global_batch_size": plan.global_batch_size,
                "seed": cfg.seed,
                "num_train_blocks": plan.num_train_blocks,
                "lr_schedule": schedule.state_dict(),
            },
            model_config=pm.hf_config,
            tokenizer_dir=Path(spec.tokenizer_dir) if spec.tokenizer_dir else None,
            keep_last=cfg.keep_last,
        )

    progress_every = max(cfg.log_every, cfg.max_steps // 20 // cfg.log_every * cfg.log_every)

    def report(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    report(
        f"training {layout.name}: {plan.num_parameters:,} parameters, "
        f"{plan.tokens_per_step:,} tokens per step, {cfg.max_steps} steps -> {run_dir}"
    )
    # The schedule's picture is taken on an early step, once warm-up is over.
    timeline_step = min(start_step + 2, cfg.max_steps - 1)
    if start_step:
        report(f"resumed from {spec.resume_from} at step {start_step}")
    initial_val_loss = evaluate()
    if initial_val_loss is not None:
        tracker.log({"val_loss": initial_val_loss}, step=start_step)
        report(f"step {start_step}: validation loss {initial_val_loss:.4f}")

    losses: list[tuple[int, float]] = []
    # Steady-state throughput: tokens over the wall time of the logged steps after the
    # first (which pays for warm-up), not a mean of per-step rates (that reads high).
    timed_tokens, timed_seconds = 0, 0.0
    peak_memory: dict[str, Any] = {}
    last_checkpoint: Path | None = None
    val_loss = initial_val_loss
    train_start = time.perf_counter()
    # Peak tensor memory is measured on one step once the optimizer's states exist; that
    # step runs under a tracker and is left out of the throughput.
    memory_step = start_step + 1 if cfg.max_steps > start_step + 1 else None
    for step in range(start_step, cfg.max_steps):
        step_start = time.perf_counter()
        microbatches = sampler.rank_microbatches(step, dims.dp_rank, dims.dp, per_device)
        if pm.runner is not None:
            pm.runner.recorder.enabled = step == timeline_step
        measuring = (
            measure_peak_memory(device, existing=persistent_tensors(pm, flat, optimizer))
            if step == memory_step
            else nullcontext()
        )
        with measuring as measured:
            optimizer.reducer.expect(len(microbatches) * pm.backward_passes_per_batch)
            loss_sum = torch.zeros((), device=device)
            for indices in microbatches:
                input_ids = train_blocks.batch(indices).to(device, non_blocking=True)
                loss_sum += pm.train_batch(input_ids, len(microbatches))
            pm.synchronize_tensor_parallel_gradients()
            grad_norm = optimizer.step()
        schedule.step()
        flat.zero_grad()
        done = step + 1
        if pm.runner is not None and step == timeline_step:
            pm.runner.recorder.enabled = False
            report_pipeline_timeline(pm, tracker, run_dir, done)
        if measured is not None:
            peak_memory = report_peak_memory(
                measured, tracker, done, plan.memory_estimate_per_rank["total"]
            )

        if done % cfg.log_every == 0 or done == cfg.max_steps:
            # The only per-step host sync: the loss, from the last pipeline stage, averaged
            # over the data-parallel ranks.
            if dims.pp > 1:
                dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=dims.pp_group)
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=dims.dp_group)
            global_loss = loss_sum.item() / dims.dp
            elapsed = time.perf_counter() - step_start
            throughput = plan.tokens_per_step / elapsed
            losses.append((done, global_loss))
            if done > start_step + 1 and step != memory_step:
                timed_tokens += plan.tokens_per_step
                timed_seconds += elapsed
            rss, peak = _rss_mb()
            tracker.log(
                {
                    "loss": global_loss,
                    "learning_rate": schedule.get_last_lr()[0],
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": throughput,
                    "step_time_s": elapsed,
                    "epoch": sampler.epoch_of(done),
                    "memory/rss_mb": rss,
                    "memory/peak_rss_mb": peak,
                    "memory/model_states_mb": state_bytes / 2**20,
                    **(
                        {"memory/cuda_peak_allocated_mb": torch.cuda.max_memory_allocated() / 2**20}
                        if device.type == "cuda"
                        else {}
                    ),
                },
                step=done,
            )
            if done % progress_every == 0 or done == cfg.max_steps:
                # Rank 0's progress line (every 5% of the run): a bar would fill the
                # launcher's per-rank log files with carriage returns.
                spent = time.perf_counter() - train_start
                remaining = spent / (done - start_step) * (cfg.max_steps - done)
                report(
                    f"step {done}/{cfg.max_steps} ({done / cfg.max_steps:.0%}, "
                    f"{_clock(spent)} elapsed, {_clock(remaining)} left) | "
                    f"loss {global_loss:.4f} | lr {schedule.get_last_lr()[0]:.2e} | "
                    f"grad norm {float(grad_norm):.3f} | {throughput:,.0f} tokens/s"
                )
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.max_steps:
            val_loss = evaluate()
            if val_loss is not None:
                tracker.log({"val_loss": val_loss}, step=done)
                report(f"step {done}: validation loss {val_loss:.4f}")
        if done % cfg.checkpoint_every == 0 or done == cfg.max_steps:
            last_checkpoint = checkpoint(done)

    train_time = time.perf_counter() - train_start
    val_loss = evaluate()
    if val_loss is not None:
        tracker.log({"val_loss": val_loss}, step=cfg.max_steps)
        report(f"step {cfg.max_steps}: validation loss {val_loss:.4f}")
    report(f"done in {train_time:.1f}s; last checkpoint {last_checkpoint}")
    tracker.flush()
    flat.check_views()
    if rank != 0:
        return None
    _, peak = _rss_mb()
    return {
        "run_dir": str(run_dir),
        "final_checkpoint": str(last_checkpoint),
        "layout_name": layout.name,
        "steps": cfg.max_steps,
        "losses": losses,
        "final_loss": losses[-1][1] if losses else None,
        "initial_val_loss": initial_val_loss,
        "final_val_loss": val_loss,
        "mean_tokens_per_s": timed_tokens / timed_seconds if timed_seconds else None,
        "train_time_s": train_time,
        "peak_rss_mb_rank0": peak,
        "model_states_bytes_rank0": state_bytes,
        "measured_peak_memory": peak_memory,
        "gradient_buckets": {
            "count": len(optimizer.reducer.buckets),
            "started_in_backward": optimizer.reducer.started_in_backward,
        },
    }


def persistent_tensors(pm: ParallelModel, flat: Any, optimizer: Any) -> list[torch.Tensor]:
    """What lives through a step: parameters and buffers of this rank's stages, the flat
    gradient buffer (the optimizer's gradient shard is a view of it) and AdamW's states."""
    tensors = [flat.params, flat.grads]
    for module in pm.modules:
        tensors.extend(module.parameters())
        tensors.extend(module.buffers())
    for state in optimizer.optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def report_peak_memory(
    measured: PeakMemory, tracker: MetricsLogger, step: int, predicted_bytes: int
) -> dict[str, Any]:
    """Gather every rank's measured peak; rank 0 logs the largest and each pipeline
    rank's, and returns them for the summary (the planner predicts the same). Collective."""
    peaks: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, measured.peak_bytes)
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    tracker.log(
        {
            "memory/peak_tensor_mb": peaks[worst] / 2**20,
            "memory/predicted_peak_mb": predicted_bytes / 2**20,
            **{f"memory/peak_tensor_mb_rank{r}": p / 2**20 for r, p in enumerate(peaks)},
        },
        step=step,
    )
    return {
        "predicted_peak_bytes": predicted_bytes,
        "peak_bytes": peaks[worst],
        "peak_rank": worst,
        "peak_bytes_per_rank": peaks,
    }


def report_pipeline_timeline(
    pm: ParallelModel, tracker: MetricsLogger, run_dir: Path, step: int
) -> None:
    """Gather one step's forward/backward spans from every pipeline rank; rank 0 draws
    them, logs the picture to MLflow and the measured bubble as a metric. Collective."""
    dims = pm.dims
    mine = pm.runner.recorder.spans if dims.dp_rank == 0 and dims.tp_rank == 0 else []
    pm.runner.recorder.spans = []
    gathered: list[tuple[int, list]] = [(0, [])] * dist.get_world_size()
    dist.all_gather_object(gathered, (dims.pp_rank, mine))
    if dist.get_rank() != 0:
        return
    spans_by_rank = {rank: spans for rank, spans in gathered if spans}
    layout = pm.layout
    microbatches = layout.pipeline_parallel_num_microbatches
    idle = idle_fraction(spans_by_rank)
    measured = sum(idle.values()) / len(idle)
    theory = theoretical_bubble(dims.pp, microbatches, layout.pipeline_parallel_virtual_stages)
    path = pipeline_timeline(
        spans_by_rank,
        run_dir / "pipeline_timeline.png",
        f"{layout.pipeline_schedule}, pp={dims.pp}, {microbatches} microbatches, step {step}: "
        f"measured bubble {measured:.0%}, theory {theory:.0%}",
    )
    tracker.log({"pipeline/bubble_fraction": measured}, step=step)
    tracker.log_artifact(path)


@torch.no_grad()
def evaluate_loss(
    pm: ParallelModel,
    blocks: BlockStore,
    eval_batches: int,
    device: torch.device,
    per_rank: int,
    global_batch: int,
) -> float:
    """Token-weighted mean loss over the first `eval_batches` global batches of validation.

    Every data-parallel rank scores a contiguous slice and the sums are
    all-reduced (over the pipeline too: only the last stage has losses), so
    the number does not depend on the layout. Batches are the per-device
    training batch, whole ones only under pipeline parallelism (the schedule
    cuts them into its microbatches).
    """
    dims = pm.dims
    pm.set_training(False)
    # `eval_batches` global batches: the same blocks whatever the layout splits them into.
    count = min(len(blocks), eval_batches * global_batch)
    share = -(-count // dims.dp)
    lo, hi = dims.dp_rank * share, min(count, (dims.dp_rank + 1) * share)
    if pm.runner is not None:
        share = share // per_rank * per_rank
        hi = lo + share if lo + share <= len(blocks) else lo
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for start in range(lo, hi, per_rank):
        input_ids = blocks.batch(list(range(start, min(hi, start + per_rank)))).to(device)
        tokens = input_ids[:, 1:].numel()
        totals[0] += pm.eval_batch(input_ids).double() * tokens
        totals[1] += tokens
    if dims.pp > 1:
        # Token counts are known on every stage; losses only on the last.
        loss = totals[:1].clone()
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=dims.pp_group)
        totals[0] = loss[0]
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=dims.dp_group)
    pm.set_training(True)
    return (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")
