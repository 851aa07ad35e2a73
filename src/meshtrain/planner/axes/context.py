"""Context parallelism (`parallel.context_parallel_size`, cp): each row's tokens split
over cp ranks holding the same parameters. Its degrees, checks and refusals, memory
terms, K/V exchange time and lines in the explanation.

Memory: What context parallelism (`StepShape.cp` > 1) adds to a rank's memory, as
`distributed/context_parallel.py` and `distributed/gathered_attention.py` run it.

Each rank holds block / cp tokens of every row (chunks r and 2cp-1-r of 2 x cp), so
every per-token term of `planner.memory` is counted at those tokens. Attention sees the
whole sequence: before each layer's attention the K and V of the cp group are
all-gathered, in the compute dtype. What the backward finds depends on the device:

- CPU (`StepShape.cp_fused_backward`): the fused kernel's backward runs on the merged
  log-sum-exp, so the forward keeps only what the rank owns (its q, K, V, the output and
  the log-sum-exps: the per-token terms already) and the gathered pair is transient. The
  backward gathers it again, makes its gradient (zeros in the compute dtype) and a copy
  in rank order for the reduce-scatter: about three gathered pairs, one layer at a time.
- Accelerators: autograd through the gather and sdpa keeps every layer's gathered pair
  for the backward (it replaces the layer's own K and V, which are a part of it); the
  backward makes its gradient and the rank-order copy, one layer at a time.

One sequence per row needs no mask (the earlier chunks whole, the own chunk causal);
packed examples do: a float additive mask per row, built once per forward and shared by
every layer, (2cp + 1) c^2 elements (c = block / 2cp).
"""

from __future__ import annotations

from meshtrain.config import RunConfig
from meshtrain.models.config_file import ArchitectureConfig
from meshtrain.planner.axes.base import AxisBase, AxisChecks
from meshtrain.planner.candidate import Candidate
from meshtrain.planner.collectives import link, ring
from meshtrain.planner.devices import GIB, DeviceProfile
from meshtrain.planner.flops import attention_excess, layer_forward_flops
from meshtrain.planner.layer_memory import local_kv_heads
from meshtrain.planner.ranking import peak, speed, versus
from meshtrain.planner.shapes import (
    BYTES_BF16,
    BYTES_FP32,
    AxisTime,
    ContextTime,
    MemoryTerms,
    ModelShape,
    StepShape,
    StepTiming,
)
from meshtrain.planner.types import Plan, Refusal, divisors, format_values

# The parameter (and `config.Layout` field) this axis owns; other modules name it here.
PARAMETER = "context_parallel_size"


def compute_bytes(step: StepShape) -> int:
    """The dtype attention runs in: bf16 under autocast or bf16 parameters, else fp32."""
    return BYTES_BF16 if step.bf16 else BYTES_FP32


def gathered_kv_bytes(m: ModelShape, step: StepShape) -> int:
    """One layer's K and V for the whole sequence, one microbatch (the tp rank's KV heads,
    a head at least: replicated where tp > KV heads). At cp 1, the layer's own K and V."""
    kv = local_kv_heads(m, step.tp) * m.head_dim
    return 2 * step.microbatch_size * step.seq_len * kv * compute_bytes(step)


def keeps_gathered_kv(step: StepShape) -> bool:
    """Whether each layer keeps the gathered pair for its backward (accelerators' autograd
    through sdpa); the CPU's fused backward gathers it again instead."""
    return step.cp > 1 and not step.cp_fused_backward


def extra_kv_bytes(m: ModelShape, step: StepShape) -> float:
    """What one layer keeps beyond the per-token count of its own K and V: where it keeps
    the gathered pair, the other ranks' share of it ((cp - 1) / cp); else nothing."""
    if not keeps_gathered_kv(step):
        return 0.0
    return gathered_kv_bytes(m, step) * (step.cp - 1) / step.cp


def mask_bytes(step: StepShape) -> int:
    """The additive masks of one forward: only packed examples have them (one sequence
    per row runs unmasked kernels). Per row, its two query chunks of c tokens over keys
    [0, (i + 1) c): (2cp + 1) c^2 elements."""
    if step.cp == 1 or not step.packed:
        return 0
    c = step.seq_len // (2 * step.cp)
    return (2 * step.cp + 1) * c * c * step.microbatch_size * compute_bytes(step)


def kv_gradient_bytes(m: ModelShape, step: StepShape) -> int:
    """Transient in a layer's backward (0 without cp): the gathered pair's gradient and
    its rank-order copy; on CPU also the pair gathered again (three pairs in all)."""
    if step.cp == 1:
        return 0
    return (2 if keeps_gathered_kv(step) else 3) * gathered_kv_bytes(m, step)


def context_breakdown(
    m: ModelShape, step: StepShape, *, layers: float, in_flight: int
) -> tuple[int, int]:
    """(gathered K/V kept, masks) at a rank's peak, both part of its activations. K/V:
    where kept, every layer's for each microbatch in flight (under full checkpointing or
    offloading only the one layer recomputed or running); on CPU none (the backward's
    transient pairs are part of its working set, `kv_gradient_bytes`). Masks: one
    forward's per microbatch in flight."""
    if not keeps_gathered_kv(step):
        return 0, mask_bytes(step) * in_flight
    kept = step.activation_checkpointing != "full" and not step.offload_effective
    kv = gathered_kv_bytes(m, step) * (layers * in_flight if kept else 1)
    return int(kv), mask_bytes(step) * in_flight


def context_parallel_degrees(world: int, block_size: int, *, search: bool = False) -> list[int]:
    """cp degrees the engine accepts: they divide the world, and each block into 2 x cp
    equal chunks (1, off, always). `search`: only the powers of two, which `auto` weighs."""
    return [
        cp
        for cp in divisors(world)
        if cp == 1 or (block_size % (2 * cp) == 0 and (not search or cp & (cp - 1) == 0))
    ]


def check_context_parallel(cp: int, world: int, block_size: int) -> list[Refusal]:
    """cp must divide the world, and each block must cut into 2 x cp equal chunks (rank r
    of the group holds chunks r and 2cp-1-r, which balances causal attention's work)."""
    if cp == 1:
        return []
    refusals = []
    degrees = context_parallel_degrees(world, block_size)
    if world % cp:
        refusals.append(
            Refusal(
                "parallel.context_parallel_size",
                cp,
                f"it must divide the world size {world}",
                f"Values that work here: {format_values(degrees)}.",
            )
        )
    elif block_size % (2 * cp):  # (a size that cannot fill the world is refused alone)
        sizes = [c for c in degrees if c > 1]
        works = (
            f"or parallel.context_parallel_size={' or '.join(map(str, sizes))}"
            if sizes
            else "or parallel.context_parallel_size=1 (off)"
        )
        lower = block_size - block_size % (2 * cp)
        refusals.append(
            Refusal(
                "data.block_size",
                block_size,
                f"context_parallel_size={cp} cuts each block into 2 x {cp} = {2 * cp} equal "
                "chunks (for causal load balance)",
                f"Use a block size divisible by {2 * cp} (e.g. {lower or 2 * cp}), {works}.",
            )
        )
    return refusals


def estimate_context_time(
    m: ModelShape, step: StepShape, device: DeviceProfile, *, microbatches: int
) -> ContextTime:
    """The K/V all-gather (forward; again in full checkpointing's recomputation, and on
    CPU in the backward, which keeps no gathered pair) and the reduce-scatter of their
    gradient (backward), per layer and microbatch, over the cp group: cp x tp
    consecutive devices (mesh order pp, dp, cp, tp). Nothing hides."""
    kv_bytes = gathered_kv_bytes(m, step)  # the whole sequence's pair, one microbatch
    kv_link = link(device, step.cp * step.tp)
    gather = ring(kv_bytes, step.cp, kv_link, device.latency_us, 1.0)
    scatter = ring(kv_bytes, step.cp, kv_link, device.latency_us, 1.0)
    gathers = 1 + int(step.activation_checkpointing == "full") + int(step.cp_fused_backward)
    layers = max(sum(step.stage_layers[s] for s in step.stages_of(rank)) for rank in range(step.pp))
    rounds = layers * microbatches
    excess = attention_excess(step)
    attention = 2 * step.seq_len * m.heads * m.head_dim * excess
    share = (
        m.layers
        * attention
        / (m.layers * layer_forward_flops(m, step.seq_len, excess) + 2 * m.hidden * m.vocab)
    )
    return ContextTime(
        all_gather_per_layer_s=gather,
        reduce_scatter_per_layer_s=scatter,
        gathers_per_layer=gathers,
        exchanges_per_step=rounds * (gathers + 1),
        total_s=rounds * (gathers * gather + scatter),
        attention_share=share,
    )


# cp is weighed where activations and loss are at least this share of the step's tensors,
# or blocks are at least this long (attention's K/V exchange is then small beside its
# compute, and a sequence's activations are what grows); not for conf/base's 128 tokens.
CP_WORTH_WEIGHING = 0.5


CP_LONG_BLOCK = 16384


def context_parallel_wanted(without_cp: list[Plan], budget: float, block_size: int) -> str | None:
    """Why `context_parallel_size: auto` should weigh cp > 1 beside the layouts planned
    without it, or None: where no layout fits, where what cp divides (activations and
    loss) is at least half the best fitting layout's step tensors, or for long blocks."""
    fitting = [p for p in without_cp if peak(p) <= budget]
    if not fitting:
        return f"no layout without it fits the {budget / GIB:.2f} GiB budget"
    best = max(fitting, key=speed)
    share = _per_token_share(best)
    if share >= CP_WORTH_WEIGHING:
        return f"activations and loss are {share:.0%} of {best.layout.name}'s step tensors"
    if block_size >= CP_LONG_BLOCK:
        return f"blocks of {block_size:,} tokens, at least {CP_LONG_BLOCK:,}"
    return None


def context_note(
    chosen: Plan, planned: list[Plan], without_cp: list[Plan], budget: float, reason: str | None
) -> str:
    """Why `context_parallel_size: auto` came out as it did, against the other side."""
    cp = chosen.layout.context_parallel_size
    head = f"parallel.context_parallel_size=auto: cp{cp}"
    if reason is None:
        return (
            f"{head}, larger sizes not weighed: activations and loss, which cp divides, are "
            f"{_per_token_share(chosen):.0%} of the step's tensors and blocks are shorter "
            f"than {CP_LONG_BLOCK:,} tokens"
        )
    with_cp = [p for p in planned if p.layout.context_parallel_size > 1 and peak(p) <= budget]
    fits = [p for p in without_cp if peak(p) <= budget]
    if cp == 1:
        rival = max(with_cp, key=speed, default=None)
        if rival is None:
            return f"{head} ({reason}); no cp layout runs here or fits either"
        return (
            f"{head} ({reason}); the fastest cp layout, {rival.layout.name}, is "
            f"{versus(chosen, rival)}"
        )
    t, memory = chosen.time_estimate, chosen.memory_estimate_per_rank
    masks = memory.get("context_mask", 0)
    exchange = (
        f"cp{cp}'s K/V exchange takes {t.get('context_parallel_s', 0.0):.2f} s per step, none "
        f"hidden behind compute; activations {memory['activations'] / GIB:.2f} GiB, of which "
        f"gathered K/V {memory.get('context_kv', 0) / GIB:.2f}"
        + (f" and masks {masks / GIB:.2f}" if masks else "")
    )
    if not fits:
        return f"{head}: {reason}; {exchange}"
    best = max(fits, key=speed)
    fastest = max([*with_cp, *fits], key=speed)
    # A cp layout wins only where no layout without cp ties with the fastest.
    tie = (
        f" and {speed(fastest) / speed(best):.3f}x behind the fastest, {fastest.layout.name}, "
        "outside the 2% tie-break"
        if fastest is not chosen
        else ""
    )
    return (
        f"{head} ({reason}); the fastest layout without cp, {best.layout.name}, is "
        f"{speed(chosen) / speed(best):.3f}x slower{tie}: step {_step_parts(best)} against "
        f"{_step_parts(chosen)}; {exchange}"
    )


def _step_parts(p: Plan) -> str:
    """A step's seconds and their nonzero parts, e.g. `66.92 s (compute 65.01, tp 1.89)`."""
    t = p.time_estimate
    parts = (
        ("compute", "compute_s"),
        ("tp", "tensor_parallel_s"),
        ("cp", "context_parallel_s"),
        ("pp", "pipeline_s"),
        ("dp", "data_parallel_s"),
    )
    named = [f"{short} {t[key]:.2f}" for short, key in parts if t.get(key, 0.0) >= 0.005]
    return f"{t['step_s']:.2f} s ({', '.join(named)})"


def _per_token_share(p: Plan) -> float:
    m = p.memory_estimate_per_rank
    return (m["activations"] + m["loss"]) / max(1, m["total"])


def context_line(plan: Plan, seq_len: int) -> str:
    """The cp layout's split of each sequence and its K/V exchange."""
    t, cp = plan.time_estimate, plan.layout.context_parallel_size
    gathers = int(t["cp_kv_all_gathers_per_layer"])
    return (
        f"  context parallel over {cp} ranks: {seq_len // cp:,} of each sequence's {seq_len:,} "
        f"tokens per rank; per layer and microbatch {gathers} K/V all-gather"
        f"{'s' if gathers > 1 else ''} of {t['cp_kv_all_gather_per_layer_s'] * 1e3:.2f} ms "
        f"and a reduce-scatter of "
        f"{t['cp_kv_reduce_scatter_per_layer_s'] * 1e3:.2f} ms, "
        f"{t['context_parallel_s']:.2f} s per step, none hidden behind compute; attention "
        f"{t['cp_attention_share']:.0%} of the compute"
    )


class ContextAxis(AxisBase):
    """Context parallelism: each row's tokens over cp ranks."""

    name = "context"
    short = "cp"
    time_parts = ("context_parallel_s",)
    parameter = PARAMETER
    splits_model = True

    def degrees(self, run: RunConfig, model_config: ArchitectureConfig) -> list[int]:
        """The powers of two the block allows (cp 1 first: the search weighs the others
        only where `context_parallel_wanted` says so)."""
        return context_parallel_degrees(run.launch.world_size, run.data.block_size, search=True)

    def check(self, c: Candidate, run: RunConfig, model_config: ArchitectureConfig) -> AxisChecks:
        world, block_size = run.launch.world_size, run.data.block_size
        return AxisChecks(
            degree=check_context_parallel(c.cp, world, block_size),
            layout={"context_parallel_size": c.cp},
        )

    def describe(self, plan: Plan, seq_len: int) -> str | None:
        return context_line(plan, seq_len) if plan.layout.context_parallel_size > 1 else None

    def memory_terms(self, m: ModelShape, step: StepShape) -> MemoryTerms:
        return MemoryTerms(
            layer={"context_kv": extra_kv_bytes(m, step)},
            microbatch={"context_mask": mask_bytes(step)},
            backward={"context_kv_gradient": kv_gradient_bytes(m, step)},
        )

    def time_terms(
        self,
        m: ModelShape,
        step: StepShape,
        device: DeviceProfile,
        timing: StepTiming,
        earlier: dict[str, float],
    ) -> AxisTime:
        if step.cp == 1:
            return AxisTime({})
        exchange = estimate_context_time(m, step, device, microbatches=timing.microbatches)
        return AxisTime({"context_parallel_s": exchange.total_s}, exchange.to_dict())


AXIS = ContextAxis()
