"""The training loop of one rank: set up, then train step after step.

`Trainer` reads top to bottom as torchtitan's does: `__init__` builds the
mesh, the rank (`components.rank_build`: the parallelised model and its
optimizer) and the data, and restores a checkpoint; `train` loops over
`train_step` (one optimizer step over this rank's microbatches,
`components.train_step`), logging, validating and checkpointing on their own
cadences; `summary` is what rank 0 returns to the launcher. The dry run
(`meshtrain.dryrun`) builds and steps through the same two functions. The
probes that measure one step (peak memory, the pipeline timeline) are
collaborators wrapped around the step, not branches of the loop. Everything
here runs inside a process group someone else made (the launcher's worker, or
a test).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshtrain.checkpoint.checkpointer import Checkpointer, OptimizerState
from meshtrain.checkpoint.lora_base import base_identity, check_same_base, checkpoint_lora_state
from meshtrain.checkpoint.manifest import CheckpointError
from meshtrain.components.metrics import (
    Throughput,
    memory_metrics,
    progress_line,
    rss_mb,
)
from meshtrain.components.rank_build import build_rank, build_reference_model
from meshtrain.components.reference_pass import reference_table
from meshtrain.components.reference_store import (
    REFERENCE_FILE,
    StoredRows,
    stored_tables,
    table_identity,
)
from meshtrain.components.step_guard import (
    NonFiniteError,
    StopRequested,
    StopSignals,
    agree_on_step,
    signal_name,
)
from meshtrain.components.step_probes import MemoryProbe, PipelineTimeline, persistent_tensors
from meshtrain.components.train_step import optimizer_step
from meshtrain.components.validation import evaluate_means
from meshtrain.config import RunConfig
from meshtrain.data.batch import TokenBatch
from meshtrain.data.blocks import BlockStore
from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.device import is_accelerator, memory_figures_mb, rank_device
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.tensor_parallel import local_tensor
from meshtrain.models.preference_loss import METRICS
from meshtrain.pipeline_schedules import last_stage_rank
from meshtrain.planner import Plan
from meshtrain.tracking.rank_metrics import MetricsLogger, TrackingTarget


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
    # Where the checkpoints go when it is object storage (a URL; `run_dir` is then a local
    # folder for the logs and the staging).
    remote_dir: str | None = None


@dataclass
class StepOutcome:
    """One optimizer step, as the logging needs it (the loss is not synchronised yet)."""

    loss_sum: torch.Tensor  # this rank's summed token losses / the step's trained tokens
    grad_norm: torch.Tensor
    started: float  # perf_counter at the step's start
    real_tokens: int  # the global batch's tokens, padding left out
    stop_signal: int = 0  # a stop signal some rank received during the step (0: none)


# An accelerator allocator's peaks and the device's use (`device.memory_figures_mb`); the
# planner's per-profile runtime and allocator terms are read off these.
DEVICE_PEAKS = ("device_peak_allocated_mb", "device_peak_reserved_mb", "device_used_mb")


def train(spec: WorkerSpec) -> dict[str, Any] | None:
    """Train for `training.max_steps` steps; rank 0 returns a summary, other ranks None."""
    return Trainer(spec).train()


class Trainer:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.run = RunConfig.from_dict(spec.run)
        self.plan = Plan.from_dict(spec.plan)
        self.layout, self.cfg = self.plan.layout, self.run.training
        self.rank = dist.get_rank()
        self.run_dir = Path(spec.run_dir)
        self.device = rank_device(self.plan.backend)
        self.dims = ParallelDims.of_layout(self.layout, self.device.type)
        # The model, its converters, the optimizer, the batch split and the LR schedule:
        # built as the dry run builds them (a resume then restores each rank's RNG state).
        self.parts = build_rank(self.run, self.plan, self.dims, self.device)
        self.pm, self.optimizer = self.parts.pm, self.parts.optimizer
        self.converters, self.lr_schedule = self.parts.converters, self.parts.lr_schedule
        self.per_device = self.parts.batch.per_device
        self.checkpointer = self._checkpointer(self.parts.optimizer_state)
        self.start_step = self._restore()
        self.train_blocks = BlockStore(spec.train_files)
        self.validation_blocks = (
            BlockStore(spec.validation_files) if spec.validation_files else None
        )
        self.reference_table: dict[str, Any] | None = None
        self.reference_logps, self.validation_reference = self._precompute_reference()
        self.sampler = GlobalBatchSampler(
            len(self.train_blocks), self.plan.global_batch_size, self.cfg.seed
        )
        self.tracker = MetricsLogger(
            TrackingTarget(spec.tracking_uri, spec.mlflow_run_id)
            if self.rank == 0 and spec.mlflow_run_id
            else None
        )
        self._set_up_probes()
        # The process's own peak after building the model and optimizer (the kernel's
        # high-water mark: what the machine feels, not a count of tensors).
        self.startup_peak_rss_mb = rss_mb()[1]
        self.losses: list[tuple[int, float]] = []
        # DPO's rewards and log-probabilities per logged step (TRL's names).
        self.preference_metrics: list[tuple[int, dict[str, float]]] = []
        # When training started (progress lines count from it); `train` restarts it after
        # the first validation, a caller driving `train_step` itself keeps this one.
        self.train_start = time.perf_counter()
        self.throughput = Throughput()
        self.last_checkpoint: Path | str | None = None
        self.stop = StopSignals()

    def _precompute_reference(self) -> tuple[StoredRows | None, StoredRows | None]:
        """DPO's precomputed reference log-probabilities of the training and validation
        blocks (None, None for any other reference), memory-mapped from the run's folder:
        made there once (the starting weights built for this pass and freed before
        training), read again by a resumed run. Collective."""
        preference = self.pm.preference
        if preference is None or preference.reference != "precompute":
            return None, None
        splits = {"train": self.train_blocks, "validation": self.validation_blocks}
        identity = table_identity(self.run.model.init_from, self.plan.model_config, splits)
        path = self.run_dir / REFERENCE_FILE
        score = partial(self._score_reference, splits)
        tables, scored = stored_tables(path, identity, score, writes=self._holds_whole_tables())
        self.reference_table = {"path": str(path), "scored": scored}
        done = "scored into" if scored else "read from"
        self._report(f"reference log-probabilities {done} {path}")
        return tables.get("train"), tables.get("validation")

    def _score_reference(self, splits: dict[str, BlockStore | None]) -> dict[str, torch.Tensor]:
        """Every block's log-probabilities under the starting weights, built for this pass
        and freed after it. Collective."""
        reference = build_reference_model(self.run, self.plan, self.dims, self.device)
        return {
            split: reference_table(reference, blocks, self.per_device, self.device)
            for split, blocks in splits.items()
            if blocks is not None
        }

    def _holds_whole_tables(self) -> bool:
        """The one rank that writes the reference table: the first of the last pipeline
        stage, where the tables are whole (gathered over dp and cp)."""
        dims = self.dims
        last = last_stage_rank(dims.pp, self.layout.pipeline_schedule)
        return dims.pp_rank == last and dims.dp_cp_rank == 0 and dims.tp_rank == 0

    def _checkpointer(self, optimizer_state: OptimizerState) -> Checkpointer:
        """The owner of this run's checkpoints, with what each of them holds."""
        return Checkpointer(
            self.run_dir,
            parameters=self.pm.parameters,
            sharding=self.pm.sharding,
            tied_copies=self.pm.tied_copies,
            optimizer=optimizer_state,
            dims=self.dims,
            model_config=self.pm.hf_config,
            run_state={
                "layout": self.layout.to_dict(),
                "layout_name": self.layout.name,
                "global_batch_size": self.plan.global_batch_size,
                "seed": self.cfg.seed,
                "num_train_blocks": self.plan.num_train_blocks,
                **self._lora_state(),
            },
            tokenizer_dir=Path(self.spec.tokenizer_dir) if self.spec.tokenizer_dir else None,
            keep_last=self.cfg.keep_last,
            in_background=self.cfg.checkpoint_async,
            remote_dir=self.spec.remote_dir,
        )

    def _trained_share(self) -> str:
        trained = self.plan.num_trainable_parameters
        if not trained or trained == self.plan.num_parameters:
            return ""
        return f" ({trained:,} trained: LoRA adapters of rank {self.layout.lora_rank})"

    def _lora_state(self) -> dict[str, Any]:
        """A LoRA run's settings and the identity of the base its adapters belong to."""
        settings = self.run.model.lora
        if settings is None:
            return {}
        base = base_identity(self.run.model.init_from, self.plan.model_config, self.cfg.seed)
        return {"lora": {"settings": dataclasses.asdict(settings), "base": base}}

    def _restore(self) -> int:
        """Load `spec.resume_from` into this rank's layout; the step to start from. LoRA
        adapters resume only onto the base they were trained on."""
        if not self.spec.resume_from:
            return 0
        root = Path(self.spec.resume_from)
        saved = checkpoint_lora_state(root)
        current = self._lora_state().get("lora")
        if (saved is None) != (current is None):
            kind = "LoRA adapters" if saved else "a full model"
            raise CheckpointError(
                f"cannot resume from {root}: it holds {kind} and this run "
                f"{'trains LoRA adapters' if current else 'trains the full model'}; set "
                f"model.lora as the checkpoint's run did ({'set' if saved else 'null'})."
            )
        if saved is not None:
            check_same_base(saved["base"], current["base"], f"resume from {root}")
        return self.checkpointer.restore(root)["step"]

    def _set_up_probes(self) -> None:
        # Peak tensor memory is measured on one step once the optimizer's states exist; that
        # step runs under a tracker and is left out of the throughput.
        memory_step = self.start_step + 1 if self.cfg.max_steps > self.start_step + 1 else None
        self.memory_probe = MemoryProbe(
            memory_step,
            self.device,
            predicted_bytes=self.plan.memory_estimate_per_rank["total"],
            tracker=self.tracker,
            existing=lambda: persistent_tensors(self.pm, self.optimizer),
        )
        # The schedule's picture is taken on an early step, once warm-up is over.
        self.timeline = PipelineTimeline(
            self.pm,
            min(self.start_step + 2, self.cfg.max_steps - 1),
            tracker=self.tracker,
            run_dir=self.run_dir,
        )

    # -- the loop ------------------------------------------------------------------------

    def train(self) -> dict[str, Any] | None:
        """Train to `training.max_steps`; rank 0 returns the summary, other ranks None."""
        cfg = self.cfg
        self._report(
            f"training {self.layout.name}: {self.plan.num_parameters:,} parameters"
            f"{self._trained_share()}, "
            f"{self.plan.tokens_per_step:,} tokens per step, {cfg.max_steps} steps -> "
            f"{self.spec.remote_dir or self.run_dir}"
        )
        if self.start_step:
            self._report(f"resumed from {self.spec.resume_from} at step {self.start_step}")
        initial_val_loss = self.validate(self.start_step)
        self.train_start = time.perf_counter()
        with self.stop:  # SIGTERM / SIGUSR1 from here on: finish the step, checkpoint, stop
            try:
                stopped = self.train_steps()
            except NonFiniteError:
                # Every rank agreed to stop: the save in flight (of an earlier, finite
                # step) completes first.
                with contextlib.suppress(CheckpointError):
                    self.checkpointer.wait()
                raise
        train_time = time.perf_counter() - self.train_start
        if stopped:
            self.tracker.flush()
            # Raised, not returned: the launcher is already shutting the workers down, and
            # a returning worker would wait for it to collect its result.
            raise StopRequested(f"{signal_name(stopped[0])} after step {stopped[1]}")
        final_val_loss = self.validate(cfg.max_steps)
        self.optimizer.wait_for_parameters()
        self._report(f"done in {train_time:.1f}s; last checkpoint {self.last_checkpoint}")
        self.optimizer.check_views()
        peaks = self.gather_peak_memory()
        self.tracker.flush()
        if self.rank != 0:
            return None
        return {**self.summary(initial_val_loss, final_val_loss, train_time), **peaks}

    def train_steps(self) -> tuple[int, int] | None:
        """The steps from `start_step` on, with their logging, validation and checkpoints.
        A stop signal ends them after the step it arrived in, with a checkpoint of that
        step: returns (the signal, the step), or None when every step ran."""
        cfg = self.cfg
        for step in range(self.start_step, cfg.max_steps):
            outcome = self.train_step(step)
            self.checkpointer.check()  # a background save's failure stops the run here
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                self.log_step(done, outcome)
            if outcome.stop_signal:
                self.last_checkpoint = self.checkpoint(done, wait=True)
                self._report(
                    f"stopped by {signal_name(outcome.stop_signal)} after step {done}: "
                    f"checkpoint {self.last_checkpoint}"
                )
                return outcome.stop_signal, done
            if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.max_steps:
                self.validate(done)
            if done % cfg.checkpoint_every == 0 or done == cfg.max_steps:
                self.last_checkpoint = self.checkpoint(done, wait=done == cfg.max_steps)
        return None

    def train_step(self, step: int) -> StepOutcome:
        """One optimizer step (0-based `step`): its microbatches, the reduction, the update
        (`components.train_step`, the dry run's step too), with this loop's data, probes
        and stop agreement."""
        started = time.perf_counter()
        microbatches = self.sampler.rank_microbatches(
            step, self.dims.dp_rank, self.dims.dp, self.per_device
        )
        # Every rank reads the whole global batch's counts (cheap, memory-mapped), so the
        # loss's denominator (trained tokens, or pairs under DPO) needs no collective.
        everyone = self.sampler.global_indices(step)
        trained_tokens = max(self._units(everyone), 1)
        batches = (self._batch(indices) for indices in microbatches)
        result = optimizer_step(
            self.parts,
            step,
            batches,
            trained_tokens,
            around=self._probes(step),
            # Every rank agrees on a stop signal, and refuses a non-finite step, before
            # the update.
            agree=partial(agree_on_step, stop=self.stop, step=step + 1),
        )
        real_tokens = self.train_blocks.real_tokens(everyone)
        return StepOutcome(
            result.loss_sum, result.grad_norm, started, real_tokens, result.stop_signal
        )

    def _units(self, indices: list[int]) -> int:
        """What the step's loss is a mean over: the blocks' trained tokens (counted without
        reading a pretraining block), or under DPO their pairs."""
        if self.pm.preference is None:
            return self.train_blocks.trained_tokens(indices)
        return self.pm.preference.units(self.train_blocks.tokens(indices))

    def _batch(self, indices: list[int]) -> TokenBatch:
        """The training blocks at `indices` on the device, with their precomputed
        reference log-probabilities where DPO uses them."""
        batch = self.train_blocks.tokens(indices)
        return batch.with_reference(self.reference_logps, indices).to(self.device)

    @contextlib.contextmanager
    def _probes(self, step: int) -> Iterator[None]:
        """The probes of one step (each measures only on its own step)."""
        with self.timeline.around(step), self.memory_probe.around(step):
            yield

    # -- logging, validation, checkpoints --------------------------------------------------

    def log_step(self, done: int, outcome: StepOutcome) -> None:
        """Log step `done` (1-based) to MLflow, and rank 0's progress line every 5% of the run.

        The loss is the only per-step host sync: from the last pipeline stage, averaged
        over the data- and context-parallel ranks. Collective."""
        loss_sum = outcome.loss_sum
        if self.dims.pp > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=self.dims.pp_group)
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=self.dims.dp_cp_group)
        loss, *more = loss_sum.reshape(-1).tolist()  # DPO: the loss, then its metrics
        elapsed = time.perf_counter() - outcome.started
        # Real tokens: a fine-tuning block's padding is not throughput.
        tokens_per_s = outcome.real_tokens / elapsed
        self.losses.append((done, loss))
        if more:
            self.preference_metrics.append((done, dict(zip(METRICS[1:], more, strict=True))))
        if done > self.start_step + 1 and done - 1 != self.memory_probe.step:
            self.throughput.add(outcome.real_tokens, elapsed)
        # The rate of the next step, as a scheduler stepped after the update reports it.
        lr, grad_norm = self.lr_schedule.rate(done), float(outcome.grad_norm)
        mfu = self.plan.mfu(tokens_per_s)
        self.tracker.log(
            {
                "loss": loss,
                "learning_rate": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tokens_per_s,
                "step_time_s": elapsed,
                "epoch": self.sampler.epoch_of(done),
                **(self.preference_metrics[-1][1] if more else {}),
                **({"mfu": mfu} if mfu is not None else {}),
                **memory_metrics(self.device, self.model_states_bytes),
                **(
                    routing.step_metrics(self.dims.dp_group, self.dims.pp_group)
                    if (routing := self.pm.routing)
                    else {}
                ),
            },
            step=done,
        )
        cfg = self.cfg
        every = max(cfg.log_every, cfg.max_steps // 20 // cfg.log_every * cfg.log_every)
        if done % every == 0 or done == cfg.max_steps:
            spent = time.perf_counter() - self.train_start
            remaining = spent / (done - self.start_step) * (cfg.max_steps - done)
            self._report(
                progress_line(
                    done,
                    cfg.max_steps,
                    spent,
                    remaining,
                    loss=loss,
                    lr=lr,
                    grad_norm=grad_norm,
                    tokens_per_s=tokens_per_s,
                )
            )

    def validate(self, step: int) -> float | None:
        """Validation loss after `step` steps, logged; None without validation. Collective."""
        if self.validation_blocks is None or self.cfg.eval_batches == 0:
            return None
        loss, *more = evaluate_means(
            self.pm,
            self.validation_blocks,
            self.cfg.eval_batches,
            self.device,
            self.per_device,
            self.plan.global_batch_size,
            self.validation_reference,
        )
        extra = {f"val_{name}": value for name, value in zip(METRICS[1:], more, strict=False)}
        self.tracker.log({"val_loss": loss, **extra}, step=step)
        line = f"step {step}: validation loss {loss:.4f}"
        if extra:
            line += (
                f", preference accuracy {extra['val_rewards/accuracies']:.1%}, "
                f"margin {extra['val_rewards/margins']:.4f}"
            )
        self._report(line)
        return loss

    def checkpoint(self, step: int, *, wait: bool = False) -> Path | str:
        """Save a checkpoint of step `step` (in the background unless `wait`, or
        `training.checkpoint_async=false`); returns its folder. Collective."""
        self.optimizer.wait_for_parameters()
        return self.checkpointer.save(step, wait=wait)

    def gather_peak_memory(self) -> dict[str, list[float]]:
        """Every rank's peak resident memory at start-up and over the run (and the CUDA
        allocator's peak), logged per rank by rank 0. Collective."""
        mine = (self.startup_peak_rss_mb, rss_mb()[1], *memory_figures_mb(self.device))
        gathered: list[tuple[float, ...]] = [mine] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        names = ("startup_peak_rss_mb", "peak_rss_mb", *DEVICE_PEAKS)
        if not is_accelerator(self.device):
            names = names[:2]
        per_rank = {name: [values[i] for values in gathered] for i, name in enumerate(names)}
        self.tracker.log(
            {
                f"memory/{name}_rank{rank}": value
                for name, values in per_rank.items()
                for rank, value in enumerate(values)
            },
            step=self.cfg.max_steps,
        )
        peaks = {f"{name}_per_rank": values for name, values in per_rank.items()}
        return peaks

    @property
    def model_states_bytes(self) -> int:
        """Parameters, gradients and this rank's optimizer states, in bytes (with a LoRA
        run's frozen base, which has parameters only)."""
        frozen = sum(
            local_tensor(p).nbytes
            for module in self.pm.modules
            for p in module.parameters()
            if not p.requires_grad
        )
        return self.optimizer.model_states_bytes + frozen

    def summary(
        self, initial_val_loss: float | None, final_val_loss: float | None, train_time: float
    ) -> dict[str, Any]:
        """What rank 0 hands back to the launcher (and the Kedro node saves)."""
        tokens_per_s = self.throughput.tokens_per_s
        return {
            "run_dir": str(self.run_dir),
            "final_checkpoint": str(self.last_checkpoint),
            "layout_name": self.layout.name,
            "steps": self.cfg.max_steps,
            "losses": self.losses,
            "preference_metrics": self.preference_metrics,
            "final_loss": self.losses[-1][1] if self.losses else None,
            "initial_val_loss": initial_val_loss,
            "final_val_loss": final_val_loss,
            "mean_tokens_per_s": tokens_per_s,
            "mean_mfu": self.plan.mfu(tokens_per_s) if tokens_per_s else None,
            "median_step_s": self.throughput.median_step_s,
            "converters": [converter.name for converter in self.converters],
            # Where and in what precision it trained: evaluation loads the model the same way.
            "backend": self.plan.backend,
            "mixed_precision": self.cfg.mixed_precision,
            "train_time_s": train_time,
            "peak_rss_mb_rank0": rss_mb()[1],
            "model_states_bytes_rank0": self.model_states_bytes,
            "measured_peak_memory": self.memory_probe.result,
            "gradient_buckets": self.optimizer.bucket_summary(),
            **self._preference_summary(),
        }

    def _preference_summary(self) -> dict[str, Any]:
        """A DPO run's settings and reference, for its evaluation (none otherwise)."""
        if self.cfg.objective != "dpo":
            return {}
        dpo = self.cfg.dpo
        return {
            "dpo": {
                "beta": dpo.beta,
                "loss_type": dpo.loss_type,
                "label_smoothing": dpo.label_smoothing,
                "reference_model": self.run.model.init_from,
                # reference=precompute: its file, and whether this run scored it.
                "reference_table": self.reference_table,
            }
        }

    def _report(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)
