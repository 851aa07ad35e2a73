"""The ranges of the number parameters whose kinds are right: one row per field (its
bound and its refusal), checked by one loop (`config_parsing.check_ranges`).

A refusal is a template of `{value}` (the value given) and `{default}` (the field's
default); it says what the number means and a value that works.
"""

from __future__ import annotations

from meshtrain.config_parsing import Bound, RangeRow

# The ranges of `training.*` numbers whose kinds are right.
TRAINING_RANGES: tuple[RangeRow, ...] = (
    (
        "grad_bucket_mb",
        Bound(low=0, low_open=True),
        "`training.grad_bucket_mb` is {value}; use a size in MiB above 0, e.g. 25 (DDP's "
        "default) or 1-4 for models of a few million parameters.",
    ),
    (
        "learning_rate",
        Bound(low=0),
        "`training.learning_rate` is {value}; use a rate of 0 or more, e.g. 3e-4 (0 trains "
        "nothing, which can check a start from model.init_from).",
    ),
    (
        "max_grad_norm",
        Bound(low=0),
        "`training.max_grad_norm` is {value}; use a norm above 0 to clip gradients to it, "
        "e.g. 1.0, or 0 for no clipping.",
    ),
    (
        "keep_last",
        Bound(low=0),
        "`training.keep_last` is {value}; use the number of complete checkpoints to keep, "
        "e.g. 2, or 0 to keep them all.",
    ),
    (
        "warmup_steps",
        Bound(low=0),
        "`training.warmup_steps` is {value}; use 0 (no warm-up) or more, e.g. 20.",
    ),
    (
        "weight_decay",
        Bound(low=0),
        "`training.weight_decay` is {value}; use 0 (none) or more, e.g. 0.1.",
    ),
    *(
        (
            beta,
            Bound(low=0, high=1, high_open=True),
            f"`training.{beta}` is {{value}}; AdamW needs a decay in [0, 1), e.g. 0.9 for "
            "adam_beta1 and 0.95 for adam_beta2.",
        )
        for beta in ("adam_beta1", "adam_beta2")
    ),
    (
        "adam_epsilon",
        Bound(low=0, low_open=True),
        "`training.adam_epsilon` is {value}; use a small number above 0, e.g. 1e-8 (AdamW "
        "divides by sqrt(v) + epsilon).",
    ),
    (
        "min_learning_rate_ratio",
        Bound(low=0, high=1),
        "`training.min_learning_rate_ratio` is {value}; the cosine decay ends at this "
        "fraction of training.learning_rate, in [0, 1], e.g. 0.1.",
    ),
    (
        "eval_batches",
        Bound(low=0),
        "`training.eval_batches` is {value}; use 0 (no validation) or more, e.g. 8.",
    ),
    (
        "loss_chunk_tokens",
        Bound(low=0),
        "`training.loss_chunk_tokens` is {value}; use the tokens the LM head and loss take "
        "at a time, e.g. 2048, 0 for the whole microbatch at once, or auto.",
    ),
)


# The ranges of `data.*` numbers whose kinds are right.
DATA_RANGES: tuple[RangeRow, ...] = (
    (
        "block_size",
        Bound(low=2),
        "`data.block_size` is {value}; a block needs at least an input and its next-token "
        "target: use 2 or more, e.g. 128.",
    ),
    (
        "validation_fraction",
        Bound(low=0, high=1, low_open=True, high_open=True),
        "`data.validation_fraction` is {value}; use a fraction strictly between 0 and 1, e.g. "
        "0.05 (both splits need documents).",
    ),
    (
        "num_proc",
        Bound(low=1),
        "`data.num_proc` is {value}; use 1 or more worker processes, or null (tokenize in "
        "this process).",
    ),
    (
        "builtin_max_chars",
        Bound(low=1),
        "`data.builtin_max_chars` is {value}; use a number of characters above 0, e.g. "
        "300000, or null for the whole built-in corpus.",
    ),
)


# The ranges of `evaluation.*` numbers whose kinds are right.
EVALUATION_RANGES: tuple[RangeRow, ...] = (
    *(
        (name, Bound(low=1), f"`evaluation.{name}` must be at least 1, got {{value}}.")
        for name in ("num_samples", "prompt_tokens", "lm_eval_batch_size")
    ),
    (
        "lm_eval_limit",
        Bound(low=1),
        "`evaluation.lm_eval_limit` is {value}; use null (every item) or at least 1.",
    ),
    (
        "temperature",
        Bound(low=0, low_open=True),
        "`evaluation.temperature` is {value}; use a value above 0, e.g. 0.8 (or "
        "evaluation.do_sample=false for greedy).",
    ),
    (
        "top_p",
        Bound(low=0, high=1, low_open=True),
        "`evaluation.top_p` is {value}; use a value in (0, 1].",
    ),
    (
        "repetition_penalty",
        Bound(low=0, low_open=True),
        "`evaluation.repetition_penalty` is {value}; use a value above 0 (1.0: none).",
    ),
)


# The ranges of `launch.*` numbers whose kinds are right.
LAUNCH_RANGES: tuple[RangeRow, ...] = (
    (
        "max_restarts",
        Bound(low=0),
        "`launch.max_restarts={value}`: use 0 (a failed worker ends the job) or more (torch "
        "elastic restarts the workers that many times).",
    ),
    (
        "monitor_interval",
        Bound(low=0, low_open=True),
        "`launch.monitor_interval={value}`: torch elastic polls the workers every this many "
        "seconds; use a value above 0, e.g. 0.5.",
    ),
    *(
        (
            name,
            Bound(low=0, low_open=True),
            f"`launch.{name}={{value}}`: use a number of seconds above 0 (default {{default:g}}).",
        )
        for name in ("shutdown_grace_s", "collective_timeout_s")
    ),
)


# `planner.*`
PLANNER_RANGES: tuple[RangeRow, ...] = (
    (
        "memory_margin",
        Bound(low=0, high=1, high_open=True),
        "`planner.memory_margin` is {value}; use a fraction in [0, 1), e.g. 0.1 to keep 10% "
        "of device memory free.",
    ),
    (
        "moe_imbalance",
        Bound(low=1),
        "`planner.moe_imbalance` is {value}; use the busiest expert-parallel rank's rows over "
        "the mean, at least 1 (1.25: 25% more; a run logs it as "
        "expert_rank_load_max_over_mean).",
    ),
)
