"""The typed run configuration, parsed and checked once.

Parameters arrive as plain dicts (from Kedro's `conf/*/parameters*.yml`, a
`--params` override, or a test). Each group becomes a frozen dataclass here;
unknown keys and values of the wrong kind are refused with the dotted name of
the parameter, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# The config room's other modules: `meshtrain.config` is where the rest of meshtrain
# imports their groups and names from.
from meshtrain.config_data import (
    BYTE_ALPHABET_SIZE,
    CHAT_TOKENS,
    EOS_TOKEN,
    LOSS_ON_BY_FORMAT,
    SPECIAL_TOKENS,
    DataConfig,
    check_data,
)
from meshtrain.config_dpo import DpoSettings
from meshtrain.config_launch import DEFAULT_RDZV_PORT, LaunchConfig, check_launch, split_endpoint
from meshtrain.config_lora import LoraSettings
from meshtrain.config_parsing import ConfigError, Refused, check_ranges, parse
from meshtrain.config_ranges import EVALUATION_RANGES, PLANNER_RANGES, TRAINING_RANGES
from meshtrain.pipeline_schedules import LOOPED, ScheduleName

__all__ = [
    "AUTO",
    "BYTE_ALPHABET_SIZE",
    "CHAT_TOKENS",
    "DEFAULT_RDZV_PORT",
    "EOS_TOKEN",
    "LOSS_ON_BY_FORMAT",
    "RUN_GROUPS",
    "SPECIAL_TOKENS",
    "ConfigError",
    "ConsolidationConfig",
    "DataConfig",
    "EvaluationConfig",
    "GROUPS",
    "LaunchConfig",
    "Layout",
    "LoraSettings",
    "ModelConfig",
    "ParallelConfig",
    "PlannerConfig",
    "Refused",
    "RunConfig",
    "RunParameters",
    "TrainingConfig",
    "check_data",
    "check_evaluation",
    "check_launch",
    "check_training",
    "parse",
    "split_endpoint",
]

AUTO = "auto"


@dataclass(frozen=True)
class ParallelConfig:
    """How the model and batch are split over ranks (`parallel.*`)."""

    data_parallel_size: int | Literal["auto"] = AUTO
    tensor_parallel_size: int | Literal["auto"] = 1
    pipeline_parallel_size: int | Literal["auto"] = 1
    pipeline_parallel_num_microbatches: int | Literal["auto"] = AUTO
    # gpipe | 1f1b | interleaved_1f1b | interleaved_zb | zbv | dualpipev
    # (`meshtrain.pipeline_schedules`: where each puts the stages, what it needs); auto:
    # the planner weighs them (not GPipe) and keeps the fastest that fits.
    pipeline_schedule: ScheduleName | Literal["auto"] = "1f1b"
    # Stages per rank for the looped schedules, interleaved_1f1b and interleaved_zb (zbv
    # and dualpipev hold two in a V; the others one).
    pipeline_parallel_virtual_stages: int = 2
    # Decoder layers per stage, to pin an uneven split; null = balanced.
    pipeline_parallel_layers: list[int] | None = None
    sequence_parallel: bool | Literal["auto"] = AUTO
    zero_1: bool | Literal["auto"] = AUTO
    # Sharded data parallelism (ZeRO-3 / FSDP2): parameters, gradients and optimizer
    # states split over groups of this many data-parallel ranks, replicated across the
    # data_parallel_size / N groups (N = dp: full sharding; 1 < N < dp: hybrid). 1 = off.
    sharded_data_parallel_degree: int | Literal["auto"] = 1
    # none | selective (recompute norms, rotary, gating) | full (recompute each layer) |
    # auto (the planner picks the least recomputation that fits).
    activation_checkpointing: Literal["none", "full", "selective", "auto"] = "none"
    activation_offloading: bool = False
    # Context parallelism: every sequence's tokens split over groups of this many ranks
    # (load-balanced for causal attention), which share the parameters as dp ranks do
    # (1 = off; auto = the planner decides; docs/context_parallel.md).
    context_parallel_size: int | Literal["auto"] = 1
    # Expert parallelism: a mixture of experts' experts split over groups of this many
    # data-parallel ranks, tokens sent to their experts' ranks and back (1 = off; auto =
    # the planner decides; docs/moe.md).
    expert_parallel_size: int | Literal["auto"] = 1


@dataclass(frozen=True)
class Layout:
    """`parallel.*` resolved by the planner: no `auto` left (the plan's `layout`)."""

    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    pipeline_parallel_num_microbatches: int
    pipeline_schedule: str
    sequence_parallel: bool
    zero_1: bool
    activation_checkpointing: str
    activation_offloading: bool
    pipeline_parallel_virtual_stages: int = 1
    pipeline_parallel_layers: list[int] | None = None  # decoder layers per stage, in order
    # FSDP2 over groups of this many dp ranks (1: off; then the flat buffer and zero_1).
    sharded_data_parallel_degree: int = 1
    # LoRA's rank (0: full fine-tuning): the base frozen, only adapters trained.
    lora_rank: int = 0
    # The loss over chunks of this many trained tokens, never the whole logits (0: over
    # the whole logits); `training.loss_chunk_tokens` as the planner resolved it.
    loss_chunk_tokens: int = 0
    # Ranks that split each sequence's tokens (1: off).
    context_parallel_size: int = 1
    # Data-parallel ranks that split a mixture of experts' experts (1: off).
    expert_parallel_size: int = 1

    @classmethod
    def one_process(cls) -> Layout:
        """One rank: every degree 1, no option on (the planner's fp32 template step)."""
        return cls(
            data_parallel_size=1,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            pipeline_parallel_num_microbatches=1,
            pipeline_schedule="1f1b",
            sequence_parallel=False,
            zero_1=False,
            activation_checkpointing="none",
            activation_offloading=False,
        )

    @property
    def sharded(self) -> bool:
        return self.sharded_data_parallel_degree > 1

    @property
    def num_stages(self) -> int:
        return self.pipeline_parallel_size * self.pipeline_parallel_virtual_stages

    @property
    def name(self) -> str:
        """A short label for run names and folders, e.g. `dp2-tp1-pp1-zero1`, `dp1-tp1-pp1-cp4`."""
        parts = [
            f"dp{self.data_parallel_size}",
            f"tp{self.tensor_parallel_size}",
            f"pp{self.pipeline_parallel_size}",
        ]
        if self.context_parallel_size > 1:
            parts.append(f"cp{self.context_parallel_size}")
        if self.expert_parallel_size > 1:
            parts.append(f"ep{self.expert_parallel_size}")
        if self.zero_1:
            parts.append("zero1")
        if self.sharded:
            parts.append(f"sdp{self.sharded_data_parallel_degree}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.pipeline_parallel_size > 1:
            schedule = self.pipeline_schedule
            if schedule in LOOPED:
                schedule += f"-v{self.pipeline_parallel_virtual_stages}"
            parts.append(f"{schedule}-mb{self.pipeline_parallel_num_microbatches}")
        if self.activation_checkpointing != "none":
            parts.append(f"ac-{self.activation_checkpointing}")
        if self.lora_rank:
            parts.append(f"lora{self.lora_rank}")
        return "-".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner plans for (`planner.*`)."""

    # auto: the visible GPU's profile, else cpu; or cpu | h100 | h200 | trn1 | trn2 | a
    # profile defined in device_profiles.
    device: str = AUTO
    # Fraction of device memory kept free of the estimate (allocator fragmentation, the
    # runtime, what the model does not count).
    memory_margin: float = 0.1
    # Field overrides per profile name, or whole new profiles (see planner/devices.py).
    device_profiles: dict[str, Any] = field(default_factory=dict)
    # Run the plan's busiest ranks on fake tensors (`meshtrain.dryrun`) and keep the
    # result with the plan.
    dry_run: bool = False
    # Under expert parallelism, the rows the busiest rank of an ep group receives over the
    # mean (dropless routing is uneven; a run logs what it measured as
    # `expert_rank_load_max_over_mean`): its dispatch buffers, all-to-alls and compute.
    moe_imbalance: float = 1.25

    def check(self) -> None:
        check_ranges(self, PLANNER_RANGES)


@dataclass(frozen=True)
class TrainingConfig:
    """The optimisation run (`training.*`)."""

    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    # When set, the global batch the planner holds fixed over every layout it weighs:
    # per_device_train_batch_size becomes the largest per-device batch per forward (per
    # pipeline microbatch under pp) and the accumulation steps follow from dp.
    global_batch_size: int | None = None
    learning_rate: float = 3e-3
    min_learning_rate_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    # Data-parallel gradient averaging in buckets of this size, each started as soon as
    # the backward has finished its gradients (off: all of them after the backward).
    overlap_grad_reduce: bool = True
    grad_bucket_mb: float = 25.0
    # ZeRO-1's parameter gather bucket by bucket in forward order, each waited for by the
    # next step's first module that reads it (off: one all-gather right after the update).
    overlap_param_gather: bool = True
    # torch.compile each decoder layer (after tensor parallelism and checkpointing):
    # fuses the elementwise work between the matmuls; pays a compile on the first steps.
    compile: bool = False
    # Where the Linear layers' fp32 matmuls run on CPU: onednn (oneDNN, inside torch), blas
    # (torch's default: MKL on x86-64), or auto: oneDNN on x86-64 CPUs with AVX-512 not
    # made by Intel, where MKL stays on AVX2 (models/cpu_linear.py). Accelerators ignore it.
    cpu_matmul: Literal["auto", "onednn", "blas"] = AUTO
    # The LM head and cross-entropy over chunks of this many tokens, so that the logits of
    # a whole microbatch never exist (models/head_loss.py); 0: over the whole logits, as
    # Hugging Face does; auto: the planner's choice for the vocabulary and device.
    loss_chunk_tokens: int | Literal["auto"] = AUTO
    max_steps: int = 200
    seed: int = 42
    # lm: next-token cross-entropy (pretraining, fine-tuning); dpo: direct preference
    # optimization on preference pairs (`training.dpo`, `models/preference_loss.py`).
    objective: Literal["lm", "dpo"] = "lm"
    dpo: DpoSettings = field(default_factory=DpoSettings)
    # no: fp32 throughout. bf16: autocast over fp32 parameters (matmuls in bf16).
    # bf16_master: bf16 parameters and activations; fp32 gradients, and an fp32 master
    # copy of the weights with AdamW's moments in the optimizer (sharded under ZeRO-1).
    mixed_precision: Literal["no", "bf16", "bf16_master"] = "no"
    # Under bf16_master, the dtype gradients are accumulated and averaged over dp in:
    # fp32 (exact accumulation) or bf16 (half the reduction bytes, as some users want).
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    checkpoint_every: int = 100
    # Checkpoints written while training goes on: each rank snapshots its files to host
    # memory (/dev/shm) and a background thread writes them (checkpoint/background.py);
    # a save waits for the one before it, a stop and the last step write synchronously,
    # and a save with no room in host memory on some rank is synchronous too.
    checkpoint_async: bool = True
    keep_last: int = 2
    resume_from: str | None = None
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 1
    output_dir: str = "data/06_models/checkpoints"
    run_name: str | None = None

    @property
    def gathers_under_forward(self) -> bool:
        """ZeRO-1's gather runs under the next forward: asked for, and no compiled layers
        (a module hook inside a compiled layer would be traced)."""
        return self.overlap_param_gather and not self.compile

    def check(self) -> None:
        """Refuse the values whose kinds are right but which cannot mean anything."""
        check_ranges(self, TRAINING_RANGES)
        self.dpo.check()
        if self.grad_reduce_dtype == "bf16" and self.mixed_precision != "bf16_master":
            raise ConfigError(
                f"`training.grad_reduce_dtype=bf16` needs `training.mixed_precision=bf16_master` "
                f"(it is {self.mixed_precision!r}): with fp32 parameters the gradients are "
                "fp32. Use grad_reduce_dtype=fp32, or mixed_precision=bf16_master."
            )
        name = self.run_name
        if name is not None and (
            not name.strip()
            or name in (".", "..")
            or any(separator in name for separator in ("/", "\\"))
        ):
            raise ConfigError(
                f"`training.run_name` is {name!r}; use one folder name (no '/', not '.' or "
                "'..'), e.g. llama-dp2-tp2: the run's checkpoints go to "
                "training.output_dir/<run_name>."
            )


@dataclass(frozen=True)
class ModelConfig:
    """What to train (`model.*`): a Hugging Face architecture and its config fields."""

    # A Hugging Face model type (llama, qwen2, qwen3, mistral); auto: the model.init_from
    # folder's, else llama.
    architecture: str = AUTO
    config: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None
    # null: full fine-tuning; else PEFT's LoraConfig fields by their PEFT names
    # (`LoraSettings`, parsed and checked with the group): only the adapters train, the
    # base is frozen.
    lora: LoraSettings | None = None

    def to_dict(self) -> dict[str, Any]:
        """The group as parameters: `lora` as it was given (see `LoraSettings.to_params`)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["config"] = dict(self.config)
        values["lora"] = self.lora.to_params() if self.lora is not None else None
        return values


@dataclass(frozen=True)
class ConsolidationConfig:
    """The Hugging Face folder made from a checkpoint (`consolidation.*`)."""

    # null: the final checkpoint of this run's training; or any checkpoint folder.
    checkpoint: str | None = None
    output_dir: str = "data/06_models/consolidated"
    # Weight files are split at this size (bytes, or 500MB, 5GB, 2GiB).
    max_shard_size: str = "5GB"
    # null: the dtype the checkpoint holds (fp32, also the master weights of a
    # bf16_master run); or float32 / bfloat16 / float16.
    dtype: str | None = None
    # A LoRA run's output_dir is PEFT's adapter folder; merge_lora also writes the base
    # with the adapters merged in (a plain Hugging Face model) to merged_output_dir.
    merge_lora: bool = False
    merged_output_dir: str = "data/06_models/merged"


@dataclass(frozen=True)
class EvaluationConfig:
    """Scoring the consolidated model with plain transformers (`evaluation.*`)."""

    batch_size: int = 16
    max_batches: int | None = None  # null: the whole validation split
    # Where and in what precision: `auto` is where and how the model trained (a GPU and
    # bf16 for an nccl bf16 run); a model too big for one GPU is spread over the visible
    # ones (device_map="auto").
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Samples: null takes `num_samples` prompts of `prompt_tokens` tokens from the
    # validation text; seeded sampling (do_sample=false: greedy).
    prompts: list[str] | None = None
    num_samples: int = 4
    prompt_tokens: int = 12
    max_new_tokens: int = 40
    do_sample: bool = True
    temperature: float = 0.8
    top_p: float = 0.95
    repetition_penalty: float = 1.3
    seed: int = 0
    # lm-evaluation-harness task names (empty: none); `lm_eval_include_path` adds a folder
    # of task YAMLs (meshtrain's own small offline tasks are always available).
    lm_eval_tasks: list[str] = field(default_factory=list)
    lm_eval_limit: int | None = None  # null: every item of each task
    lm_eval_include_path: str | None = None
    lm_eval_batch_size: int = 8
    # Log the consolidated model to the MLflow run (off for huge models or slow stores).
    log_model: bool = True

    def check(self) -> None:
        """Refuse the values whose kinds are right but which mean nothing."""
        if not _EVAL_DEVICE.fullmatch(self.device):
            raise ConfigError(
                f"`evaluation.device` is {self.device!r}; use auto (where the model "
                "trained), cpu, cuda or cuda:N."
            )
        check_ranges(self, EVALUATION_RANGES)


_EVAL_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_evaluation(evaluation: EvaluationConfig) -> None:
    """`evaluation.check()`, under the name the evaluation node calls."""
    evaluation.check()


def check_training(training: TrainingConfig) -> None:
    """`training.check()`, under its former name."""
    training.check()


@dataclass(frozen=True)
class RunConfig:
    """All parameter groups together, as the planner and workers see them."""

    parallel: ParallelConfig
    training: TrainingConfig
    launch: LaunchConfig
    model: ModelConfig
    data: DataConfig
    planner: PlannerConfig = field(default_factory=PlannerConfig)

    @classmethod
    def from_params(
        cls,
        *,
        parallel: dict | None = None,
        training: dict | None = None,
        launch: dict | None = None,
        model: dict | None = None,
        data: dict | None = None,
        planner: dict | None = None,
    ) -> RunConfig:
        given = {"parallel": parallel, "training": training, "launch": launch}
        given |= {"model": model, "data": data, "planner": planner}
        run_groups = [group for group in GROUPS if group in given]  # in GROUPS' order
        return cls(**{group: read_group(group, given[group]) for group in run_groups})

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {group: group_params(getattr(self, group)) for group in RUN_GROUPS}

    @classmethod
    def from_dict(cls, values: dict[str, dict[str, Any]]) -> RunConfig:
        return cls.from_params(**values)


# The parameter groups a `RunConfig` is made of, in its order.
RUN_GROUPS = tuple(f.name for f in dataclasses.fields(RunConfig))

# Every parameter group by its name in `conf/*/parameters*.yml`, in the order they are
# parsed: a run with mistakes in several groups meets the first.
GROUPS: dict[str, type] = {
    "planner": PlannerConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "launch": LaunchConfig,
    "consolidation": ConsolidationConfig,
    "evaluation": EvaluationConfig,
}


def read_group(group: str, values: dict[str, Any] | None) -> Any:
    """Parameter group `group` as given (a dict from YAML or `--params`, or None: every
    default) -> its typed dataclass, with the checks the group owns (its `check()`)."""
    config = parse(GROUPS[group], values, group)
    check = getattr(config, "check", None)
    if check is not None:
        check()
    return config


def group_params(config: Any) -> dict[str, Any]:
    """A typed group back as its parameters (its `to_dict()` where it has one)."""
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if to_dict is not None else dataclasses.asdict(config)


class RunParameters:
    """A run's parameters (Kedro's `parameters`: every group by name), each group parsed,
    with its own checks, once, when first asked for: the raw dicts end here."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self._params = params
        self._groups: dict[str, Any] = {}

    def group(self, name: str) -> Any:
        if name not in self._groups:
            self._groups[name] = read_group(name, self._params.get(name))
        return self._groups[name]

    def parse(self, names: Collection[str]) -> RunParameters:
        """Parse each of the groups `names`, in `GROUPS`' order: the first value a group's
        own checks refuse is refused (`ConfigError`) before anything heavy is imported."""
        for name in GROUPS:
            if name in names:
                self.group(name)
        return self

    @property
    def model(self) -> ModelConfig:
        return self.group("model")

    @property
    def data(self) -> DataConfig:
        return self.group("data")

    @property
    def run(self) -> RunConfig:
        return RunConfig(**{name: self.group(name) for name in RUN_GROUPS})
