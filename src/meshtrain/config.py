"""The typed run configuration, parsed and checked once.

Parameters arrive as plain dicts (from Kedro's `conf/*/parameters*.yml`, a
`--params` override, or a test). Each group becomes a frozen dataclass here;
unknown keys and values of the wrong kind are refused with the dotted name of
the parameter, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from meshtrain.config_lora import LoraSettings as LoraSettings  # `model.lora`, re-exported
from meshtrain.config_lora import check_lora, peft_only_defaults
from meshtrain.config_parsing import ConfigError, check_ranges, out_of_range, parse
from meshtrain.config_parsing import Refused as Refused  # the refusals' base, re-exported
from meshtrain.config_ranges import (
    DATA_RANGES,
    EVALUATION_RANGES,
    LAUNCH_RANGES,
    PLANNER_RANGES,
    TRAINING_RANGES,
)

AUTO = "auto"
# c10d's own default port, used when launch.rdzv_endpoint names no port (as torchrun does).
DEFAULT_RDZV_PORT = 29400


@dataclass(frozen=True)
class ParallelConfig:
    """How the model and batch are split over ranks (`parallel.*`)."""

    data_parallel_size: int | Literal["auto"] = AUTO
    tensor_parallel_size: int | Literal["auto"] = 1
    pipeline_parallel_size: int | Literal["auto"] = 1
    pipeline_parallel_num_microbatches: int | Literal["auto"] = AUTO
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    # Virtual stages per rank for interleaved 1F1B (ignored by the other schedules).
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
        if self.zero_1:
            parts.append("zero1")
        if self.sharded:
            parts.append(f"sdp{self.sharded_data_parallel_degree}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.pipeline_parallel_size > 1:
            schedule = self.pipeline_schedule
            if schedule == "interleaved_1f1b":
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
    # no: fp32 throughout. bf16: autocast over fp32 parameters (matmuls in bf16).
    # bf16_master: bf16 parameters and activations; fp32 gradients, and an fp32 master
    # copy of the weights with AdamW's moments in the optimizer (sharded under ZeRO-1).
    mixed_precision: Literal["no", "bf16", "bf16_master"] = "no"
    # Under bf16_master, the dtype gradients are accumulated and averaged over dp in:
    # fp32 (exact accumulation) or bf16 (half the reduction bytes, as some users want).
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    checkpoint_every: int = 100
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


@dataclass(frozen=True)
class LaunchConfig:
    """Process start-up (`launch.*`), with torchrun's meanings."""

    nproc_per_node: int = 2
    nnodes: int = 1
    node_rank: int = 0
    backend: Literal["auto", "gloo", "nccl", "neuron"] = AUTO
    rdzv_endpoint: str | None = None
    rdzv_id: str = "meshtrain"
    # Several hosts: the interface the nodes reach each other on (e.g. eth1, ib0); null:
    # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME where set, else the route to rdzv_endpoint.
    network_interface: str | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.5
    # On SIGTERM / SIGUSR1 (preemption, a SLURM time limit) the workers finish the step
    # and write a checkpoint; after this many seconds the launcher kills them anyway.
    shutdown_grace_s: float = 120.0
    # How long a collective waits for a rank that makes no progress before the job fails.
    collective_timeout_s: float = 600.0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`, or a bare host meaning c10d's port 29400) -> (host, port)."""
    text = endpoint.strip()
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""  # a bare host name, or a bare IPv6 address
    if not port:
        return host, DEFAULT_RDZV_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"`launch.rdzv_endpoint` got {endpoint!r}: the port must be a number from 1 to "
            "65535, as in `node001:29500`."
        )
    return host, int(port)


def check_launch(launch: LaunchConfig) -> None:
    """Refuse a launch that cannot rendezvous, naming every problem, before anything starts
    (`launch.job.run_training` asks first; planning for another cluster does not need it).

    On several nodes a wrong value would otherwise surface as a rendezvous that
    waits ten minutes for a node that never comes, or as two nodes that both
    think they are node 1.
    """
    problems = []
    if not 0 <= launch.node_rank < launch.nnodes:
        problems.append(
            f"`launch.node_rank={launch.node_rank}` is outside 0 .. launch.nnodes - 1 = "
            f"{launch.nnodes - 1}: each node passes its own number, 0 on the node named by "
            "launch.rdzv_endpoint (on SLURM: launch.node_rank=$SLURM_NODEID)."
        )
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        problems.append(
            f"`launch.nnodes={launch.nnodes}` needs `launch.rdzv_endpoint=HOST:PORT`, the same "
            "on every node: HOST is node 0's host name or address (on SLURM the first of "
            "`scontrol show hostnames $SLURM_JOB_NODELIST`), PORT a free port there, e.g. 29500."
        )
    if launch.rdzv_endpoint:
        try:
            host, _ = split_endpoint(launch.rdzv_endpoint)
            if not host:
                problems.append(
                    f"`launch.rdzv_endpoint={launch.rdzv_endpoint}` names no host; "
                    "write HOST:PORT, e.g. node001:29500."
                )
        except ConfigError as error:
            problems.append(str(error))
    problems += out_of_range(launch, LAUNCH_RANGES)
    if launch.nnodes > 1 and not launch.rdzv_id.strip():
        problems.append(
            "`launch.rdzv_id` is empty: with several nodes it must be the same on every "
            "node and new for each job, e.g. launch.rdzv_id=$SLURM_JOB_ID."
        )
    if problems:
        raise ConfigError(
            "meshtrain refused the launch before starting any worker:\n  - "
            + "\n  - ".join(problems)
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
    # (`LoraSettings`): only the adapters train, the base is frozen.
    lora: dict[str, Any] | None = None

    @property
    def lora_settings(self) -> LoraSettings | None:
        """`lora` parsed and checked (None: full fine-tuning)."""
        if self.lora is None:
            return None
        settings = parse(LoraSettings, peft_only_defaults(self.lora), "model.lora")
        check_lora(settings)
        return settings


@dataclass(frozen=True)
class DataConfig:
    """Corpus or fine-tuning examples, tokenizer and packing (`data.*`)."""

    # builtin / text_files / hub: a text corpus. files: JSON, JSONL, Parquet or CSV files
    # (`data_files`); catalog: the Kedro dataset `raw_examples`; builtin_instructions:
    # question/answer conversations made offline from Python's documentation.
    source: Literal["builtin", "text_files", "hub", "files", "catalog", "builtin_instructions"] = (
        "builtin"
    )
    text_files: list[str] | None = None
    data_files: list[str] | None = None
    hub_dataset: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"
    text_column: str = "text"
    # The dataset's own column names for TRL's, e.g. {messages: conversations}.
    columns: dict[str, str] | None = None
    # TRL's formats; auto: from the columns (messages, prompt + completion, text).
    format: Literal["auto", "text", "prompt_completion", "conversational"] = "auto"
    # Which tokens carry the loss; auto: completion for prompt/completion data, assistant
    # for conversations, all for text.
    loss_on: Literal["auto", "all", "completion", "assistant"] = "auto"
    # stream: documents concatenated and cut into blocks (pretraining); bfd: whole examples
    # best-fit into blocks, positions restarting and attention kept inside each example;
    # auto: stream for a text corpus, bfd for fine-tuning examples.
    packing: Literal["auto", "stream", "bfd"] = "auto"
    # An example longer than a block (bfd): drop it (counted), truncate it, or off (refuse).
    truncation: Literal["drop", "truncate", "off"] = "drop"
    # A Jinja chat template file replacing the tokenizer's own.
    chat_template: str | None = None
    builtin_max_chars: int | None = None
    tokenizer: str | None = None
    vocab_size: int = 4096
    block_size: int = 128
    validation_fraction: float = 0.05
    seed: int = 1234
    num_proc: int | None = 2


# The byte-level BPE tokenizer trained when `data.tokenizer` is null (data/tokenizer.py
# builds it from these): a token per byte and the special tokens, before any merge.
BYTE_ALPHABET_SIZE = 256
EOS_TOKEN = "<|endoftext|>"
"""Separates documents when packing; also serves as bos and pad."""
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
"""ChatML's turn markers: the trained tokenizer's chat template opens and ends turns with
them, so a model pretrained here can be fine-tuned on conversations."""
SPECIAL_TOKENS = (EOS_TOKEN, *CHAT_TOKENS)


def check_data(data: DataConfig) -> None:
    """Refuse the `data.*` values whose kinds are right but which cannot make a corpus or
    blocks, before any data is read or written."""
    if data.source == "text_files" and not data.text_files:
        raise ConfigError(
            "`data.source=text_files` needs `data.text_files`, the paths or glob patterns of "
            "the text files, e.g. data.text_files=/corpus/*.txt."
        )
    if data.source == "hub" and not data.hub_dataset:
        raise ConfigError(
            "`data.source=hub` needs `data.hub_dataset`, a Hugging Face dataset id, e.g. "
            "data.hub_dataset=Salesforce/wikitext with data.hub_config=wikitext-103-raw-v1."
        )
    if data.source == "files" and not data.data_files:
        raise ConfigError(
            "`data.source=files` needs `data.data_files`, the paths or glob patterns of JSON, "
            "JSONL, Parquet or CSV files, e.g. data.data_files=data/01_raw/chats/*.jsonl."
        )
    if data.packing == "stream" and data.source == "builtin_instructions":
        raise ConfigError(
            "`data.packing=stream` concatenates text; the builtin instructions are "
            "conversations: use data.packing=bfd (or auto)."
        )
    check_ranges(data, DATA_RANGES)
    if not data.text_column.strip():
        raise ConfigError("`data.text_column` is empty; name the corpus column, e.g. text.")
    minimum = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS) + 1
    if data.tokenizer is None and data.vocab_size < minimum:
        raise ConfigError(
            f"`data.vocab_size` is {data.vocab_size}; the byte-level tokenizer trained here "
            f"needs at least {minimum} (256 byte tokens, {len(SPECIAL_TOKENS)} special, one "
            "merge), e.g. 4096."
        )


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


_EVAL_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_evaluation(evaluation: EvaluationConfig) -> None:
    """Refuse the `evaluation.*` values whose kinds are right but which mean nothing."""
    if not _EVAL_DEVICE.fullmatch(evaluation.device):
        raise ConfigError(
            f"`evaluation.device` is {evaluation.device!r}; use auto (where the model "
            "trained), cpu, cuda or cuda:N."
        )
    check_ranges(evaluation, EVALUATION_RANGES)


def check_training(training: TrainingConfig) -> None:
    """Refuse the `training.*` values whose kinds are right but which cannot mean anything."""
    check_ranges(training, TRAINING_RANGES)
    if training.grad_reduce_dtype == "bf16" and training.mixed_precision != "bf16_master":
        raise ConfigError(
            f"`training.grad_reduce_dtype=bf16` needs `training.mixed_precision=bf16_master` "
            f"(it is {training.mixed_precision!r}): with fp32 parameters the gradients are "
            "fp32. Use grad_reduce_dtype=fp32, or mixed_precision=bf16_master."
        )
    name = training.run_name
    if name is not None and (
        not name.strip()
        or name in (".", "..")
        or any(separator in name for separator in ("/", "\\"))
    ):
        raise ConfigError(
            f"`training.run_name` is {name!r}; use one folder name (no '/', not '.' or '..'), "
            "e.g. llama-dp2-tp2: the run's checkpoints go to training.output_dir/<run_name>."
        )


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
        planner_config = parse(PlannerConfig, planner, "planner")
        check_ranges(planner_config, PLANNER_RANGES)
        training_config = parse(TrainingConfig, training, "training")
        check_training(training_config)
        data_config = parse(DataConfig, data, "data")
        check_data(data_config)
        model_config = parse(ModelConfig, model, "model")
        _ = model_config.lora_settings  # refused here, with the other groups
        return cls(
            parallel=parse(ParallelConfig, parallel, "parallel"),
            training=training_config,
            launch=parse(LaunchConfig, launch, "launch"),
            model=model_config,
            data=data_config,
            planner=planner_config,
        )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, dict[str, Any]]) -> RunConfig:
        return cls.from_params(**values)


# The parameter groups a `RunConfig` is made of, in its order.
RUN_GROUPS = tuple(f.name for f in dataclasses.fields(RunConfig))
