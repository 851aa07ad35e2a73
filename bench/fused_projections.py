"""Fused q/k/v and gate/up projections, and torch.compile'd decoder layers, against the
Hugging Face Llama's separate projections: one-process training steps (issue #19).

Does "fewer, bigger kernels" train faster on these CPUs? Each side trains the same Llama
(fp32, sdpa attention, no KV cache) with the same step: forward, cross-entropy of the
logits against the next token of random token ids, backward, fused `torch.optim.AdamW`
step, `zero_grad`. The sides:

- `hf`: the Hugging Face model untouched (reference).
- `hf+rms_norm` (asked for with `--sides`): the same with every RMSNorm computed by one
  `torch.nn.functional.rms_norm` kernel instead of Hugging Face's five elementwise passes
  (same arithmetic in fp32), compared with `hf`.
- `separate`: each decoder layer's attention and MLP replaced by this file's modules with
  three Linears q, k, v and two Linears gate, up (the HF weights themselves).
- `fused`: the same modules but ONE Linear for q, k, v (weight [q; k; v], as
  optimum-neuron's `fuse_qkv`) and ONE for gate, up (weight [gate; up]), their output
  split. Both replacement modules share every other line (rotary by transformers'
  `apply_rotary_pos_emb`, `scaled_dot_product_attention(is_causal=True, enable_gqa=True)`,
  o_proj, SiLU(gate) * up, down_proj), so `fused / separate` measures the fusion alone.
- `separate again`: a second `separate` model, the A/A control of this noisy machine.
- with `--compile`, `separate+compile` and `fused+compile`: every decoder layer
  `layer.compile()`d in place; compiled in the warm-up (its first step, reported as the
  compile time), never in the timed steps.

Before timing, `separate`, `fused`, `hf` and `hf+rms_norm`, built from the same weights, must give
the same loss (1e-5 relative) and the same gradients (the fused ones against the
concatenated separate ones, 1e-5 relative in norm) on one batch; else the script aborts.

How it times: every side is built once, from the same seeded weights, in this ONE
process (fine for a relative comparison: the sides share the process's allocator, thread
pool and machine noise). After `--warmup` steps per side, `--rounds` rounds each time a
block of `--steps` steps per side, one step at a time, the order of the sides reversed
on every other round. Per side: the median step time over all its timed steps,
tokens/s (batch x sequence per step), the model FLOP rate (per token as training runs
count it for their `mfu`: 6 x the matmul weights + 12 x layers x hidden x sequence) and
its fraction of this process's fp32 GEMM rate at the same threads (`torch.mm` of
2048 x 2048, median of 10). Ratios are of tokens/s (above 1: faster than `separate`),
overall (of the medians) and per round (of each round's block medians).

    .venv/bin/python bench/fused_projections.py [--shape 27m|110m|both] [--compile]
        [--threads 2] [--steps 3] [--rounds 4] [--warmup 2] [--sides hf,separate,...]

Rough durations on these 2 cores at the defaults (a step is ~6 s at 27m, ~26 s at 110m,
timed while other jobs shared the cores): 27m about 6 minutes, with --compile about 10
(each compiled side's first step ~25-50 s); 110m about 26 minutes, with --compile about
40; `--steps 2 --rounds 3` roughly halves each. Memory: about 1.3 GB per 110m side
between its steps (weights, AdamW states; ~8 GB for all six), 0.35 GB per 27m side.
Prints tables; asserts nothing but the equivalence check.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

for _name, _value in {
    "KEDRO_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from shapes import model_flops_per_token  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoModelForCausalLM, PretrainedConfig  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from meshtrain.models import build_model_config  # noqa: E402

SEED, DATA_SEED, BATCH_POOL = 42, 0, 4
LEARNING_RATE, WEIGHT_DECAY = 3e-3, 0.1
TOLERANCE = 1e-5
GEMM_SIZE, GEMM_REPEATS = 2048, 10
# hidden, intermediate, layers, heads, KV heads, vocab, sequence, batch
SHAPES: dict[str, tuple[int, ...]] = {
    "27m": (512, 1344, 8, 8, 4, 4096, 256, 4),
    "110m": (768, 3072, 12, 12, 4, 4096, 512, 2),
}
BASE_SIDES = ("hf", "separate", "fused", "separate again")
# The Hugging Face model with meshtrain's one-kernel RMSNorm (models/llama/rms_norm.py).
NORM_SIDE = "hf+rms_norm"
COMPILE_SIDES = ("separate+compile", "fused+compile")


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    batch: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


# --------------------------------------------------------------------------- the modules


class Attention(nn.Module):
    """Llama self-attention on the HF decoder layer's interface; `project` gives q, k, v."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_size = config.num_attention_heads * self.head_dim
        self.kv_size = config.num_key_value_heads * self.head_dim

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:
            raise ValueError("these modules attend causally only: no attention mask")
        batch, seq, _ = hidden_states.shape
        q, k, v = self.project(hidden_states)
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out = out.transpose(1, 2).reshape(batch, seq, self.q_size)
        return self.o_proj(out), None


class SeparateAttention(Attention):
    """q, k, v by three Linears: the HF layer's own."""

    def __init__(self, hf: nn.Module, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            hf.q_proj,
            hf.k_proj,
            hf.v_proj,
            hf.o_proj,
        )

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class FusedAttention(Attention):
    """q, k, v by one Linear of weight [q; k; v], its output split."""

    def __init__(self, hf: nn.Module, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.qkv_proj = fused_linear(hf.q_proj, hf.k_proj, hf.v_proj)
        self.o_proj = hf.o_proj

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        return q, k, v


class MLP(nn.Module):
    """Llama's SwiGLU MLP: down(SiLU(gate) * up); `gate_up` gives gate, up."""

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class SeparateMLP(MLP):
    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = hf.gate_proj, hf.up_proj, hf.down_proj

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(x), self.up_proj(x)


class FusedMLP(MLP):
    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = fused_linear(hf.gate_proj, hf.up_proj)
        self.down_proj = hf.down_proj

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return gate, up


def fused_linear(*linears: nn.Linear) -> nn.Linear:
    """One bias-free Linear whose weight is the row concatenation of `linears`' weights."""
    if any(linear.bias is not None for linear in linears):
        raise ValueError("the fused projections assume bias-free Linears (Llama's)")
    weight = torch.cat([linear.weight.detach() for linear in linears], dim=0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        fused.weight.copy_(weight)
    return fused


# --------------------------------------------------------------------------- the models


def hf_config(shape: Shape) -> PretrainedConfig:
    fields = {
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": max(512, shape.seq),
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    config = build_model_config("llama", fields, vocab_size=shape.vocab)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return config


def base_model(config: PretrainedConfig) -> nn.Module:
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.train()


def _one_kernel_norm(norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden_states, norm.weight.shape, norm.weight, norm.variance_epsilon)


def fuse_rms_norms(model: nn.Module) -> None:
    """Every RMSNorm of `model` as one `rms_norm` kernel (its weight and name kept)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = functools.partial(_one_kernel_norm, module)


def side_model(base: nn.Module, config: PretrainedConfig, side: str) -> nn.Module:
    """A copy of `base` with the side's attention and MLP, compiled per layer if asked."""
    model = copy.deepcopy(base)
    if side == "hf":
        return model
    if side == NORM_SIDE:
        fuse_rms_norms(model)
        return model
    fused = side.startswith("fused")
    for layer in model.model.layers:
        hf_attn, hf_mlp = layer.self_attn, layer.mlp
        if fused:
            layer.self_attn, layer.mlp = FusedAttention(hf_attn, config), FusedMLP(hf_mlp)
        else:
            layer.self_attn = SeparateAttention(hf_attn, config)
            layer.mlp = SeparateMLP(hf_mlp)
        if side.endswith("+compile"):
            layer.compile()
    return model


def batches(shape: Shape) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(DATA_SEED)
    size = (shape.batch, shape.seq)
    return [torch.randint(0, shape.vocab, size, generator=generator) for _ in range(BATCH_POOL)]


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


# --------------------------------------------------------------------------- the check


FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def grads_in_fused_layout(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model's gradients under the fused model's names: a separate (or hf) model's q, k,
    v and gate, up concatenated as the fused weights are; a fused model's as they are."""
    grads = {name: p.grad for name, p in model.named_parameters()}
    merged = {part for parts in FUSED_PARTS.values() for part in parts}
    out: dict[str, torch.Tensor] = {}
    for name, grad in grads.items():
        module, _, leaf = name.rpartition(".")[0].rpartition(".")
        if leaf not in merged:
            out[name] = grad
            continue
        for fused, parts in FUSED_PARTS.items():
            if leaf == parts[0]:
                pieces = [grads[f"{module}.{part}.weight"] for part in parts]
                out[f"{module}.{fused}.weight"] = torch.cat(pieces)
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_equivalence(base: nn.Module, config: PretrainedConfig, ids: torch.Tensor) -> None:
    """Abort unless `fused` and `hf` give `separate`'s loss and gradients on `ids`."""
    sides = ("separate", "fused", "hf", NORM_SIDE)
    models = {side: side_model(base, config, side) for side in sides}
    losses, grads = {}, {}
    for side, model in models.items():
        loss = lm_loss(model, ids)
        loss.backward()
        losses[side] = loss.detach()
        grads[side] = grads_in_fused_layout(model)
    reference, failed = grads["separate"], False
    parts = [f"loss separate {losses['separate'].item():.6f}"]
    for side in ("fused", "hf", NORM_SIDE):
        if set(grads[side]) != set(reference):
            raise SystemExit(f"check: {side}'s parameters do not map onto separate's")
        loss_error = relative(losses[side], losses["separate"])
        grad_error = max(relative(grads[side][n], reference[n]) for n in reference)
        failed |= loss_error > TOLERANCE or grad_error > TOLERANCE
        parts.append(f"{side}: loss rel. diff {loss_error:.1e}, grads max {grad_error:.1e}")
    print("check (one batch, same weights): " + "; ".join(parts))
    if failed:
        raise SystemExit(f"check FAILED: a relative difference above {TOLERANCE:g}")
    print(f"check: ok (all within {TOLERANCE:g})")


# --------------------------------------------------------------------------- the timing


@dataclass
class Runner:
    """One side: its model, optimizer, and the step times it measured."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    warmup_s: list[float] = field(default_factory=list)
    rounds: list[list[float]] = field(default_factory=list)
    calls: int = 0

    def step(self, pool: list[torch.Tensor]) -> float:
        ids = pool[self.calls % len(pool)]
        self.calls += 1
        start = time.perf_counter()
        loss = lm_loss(self.model, ids)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    @property
    def median_s(self) -> float:
        return statistics.median(t for block in self.rounds for t in block)


def make_runner(base: nn.Module, config: PretrainedConfig, side: str) -> Runner:
    model = side_model(base, config, side.removesuffix(" again"))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, fused=True
    )
    return Runner(side, model, optimizer)


def time_sides(runners: list[Runner], pool: list[torch.Tensor], args: argparse.Namespace) -> None:
    for runner in runners:
        runner.warmup_s = [runner.step(pool) for _ in range(args.warmup)]
        print(f"  warm-up {runner.name}: " + " ".join(f"{t:.2f}" for t in runner.warmup_s) + " s")
    for index in range(args.rounds):
        order = runners if index % 2 == 0 else runners[::-1]
        for runner in order:
            runner.rounds.append([runner.step(pool) for _ in range(args.steps)])
        medians = ", ".join(f"{r.name} {statistics.median(r.rounds[-1]):.3f}" for r in runners)
        print(f"  round {index + 1} median step s: {medians}")


def gemm_gflops() -> float:
    """fp32 `torch.mm` of GEMM_SIZE squares at this process's threads: median GFLOP/s."""
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    out = torch.empty(GEMM_SIZE, GEMM_SIZE)
    for _ in range(3):
        torch.mm(a, b, out=out)
    times = []
    for _ in range(GEMM_REPEATS):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - start)
    return 2 * GEMM_SIZE**3 / statistics.median(times) / 1e9


# --------------------------------------------------------------------------- the report


def print_sides(runners: list[Runner], shape: Shape, flops: int, gemm: float) -> None:
    print(f"\n{shape.name}: per side, median of {sum(map(len, runners[0].rounds))} timed steps")
    header = ("side", "first step s", "median step s", "tokens/s", "GFLOP/s", "of GEMM")
    print(f"  {header[0]:<18}" + "".join(f"{h:>15}" for h in header[1:]))
    for runner in runners:
        rate = shape.tokens / runner.median_s
        gflops = rate * flops / 1e9
        cells = (runner.warmup_s[0] if runner.warmup_s else float("nan"), runner.median_s)
        row = f"  {runner.name:<18}" + "".join(f"{c:>15.3f}" for c in cells)
        print(row + f"{rate:>15.1f}{gflops:>15.2f}{gflops / gemm:>15.3f}")
    for runner in runners:
        if runner.name.endswith("+compile") and runner.warmup_s:
            compile_s = runner.warmup_s[0] - runner.median_s
            print(f"  {runner.name}: compile time ~{compile_s:.1f} s (first step - median step)")
    print(f"  fp32 GEMM ({GEMM_SIZE}^2 torch.mm, this process): {gemm:.2f} GFLOP/s")


def print_ratios(runners: list[Runner]) -> None:
    by_name = {runner.name: runner for runner in runners}
    pairs = [
        ("fused", "separate"),
        ("separate+compile", "separate"),
        ("fused+compile", "separate"),
        ("fused+compile", "separate+compile"),
        ("hf", "separate"),
        (NORM_SIDE, "hf"),
        ("separate again", "separate"),
    ]
    print("  ratios of tokens/s (above 1: the first is faster), overall | per round")
    for top, bottom in pairs:
        if top not in by_name or bottom not in by_name:
            continue
        a, b = by_name[top], by_name[bottom]
        label = f"{top} / {bottom}" + ("  (A/A)" if top == "separate again" else "")
        per_round = [
            statistics.median(rb) / statistics.median(ra)
            for ra, rb in zip(a.rounds, b.rounds, strict=True)
        ]
        rounds = " ".join(f"{r:.3f}" for r in per_round)
        print(f"  {label:<38}{b.median_s / a.median_s:>7.3f} | {rounds}")


# --------------------------------------------------------------------------- main


def run_shape(shape: Shape, sides: list[str], args: argparse.Namespace, gemm: float) -> None:
    config = hf_config(shape)
    base = base_model(config)
    pool = batches(shape)
    print(
        f"\n== {shape.name}: hidden {shape.hidden}, intermediate {shape.intermediate}, "
        f"{shape.layers} layers, {shape.heads} heads / {shape.kv_heads} KV, vocab "
        f"{shape.vocab}, sequence {shape.seq}, batch {shape.batch} ({shape.tokens} tokens "
        f"a step); {torch.get_num_threads()} threads; {args.warmup} warm-up + "
        f"{args.steps} steps x {args.rounds} rounds per side"
    )
    check_equivalence(base, config, pool[0])
    runners = [make_runner(base, config, side) for side in sides]
    flops = model_flops_per_token(config, shape.seq)
    del base
    print(f"  model FLOPs per token: {flops / 1e6:.1f} M")
    time_sides(runners, pool, args)
    print_sides(runners, shape, flops, gemm)
    print_ratios(runners)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=(*SHAPES, "both"), default="27m")
    parser.add_argument("--compile", action="store_true", help="add the compiled sides")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per side")
    parser.add_argument("--sides", default=None, help="comma list; default: all")
    args = parser.parse_args()
    known = (*BASE_SIDES, NORM_SIDE, *COMPILE_SIDES)
    default = [*BASE_SIDES, *(COMPILE_SIDES if args.compile else ())]
    args.side_list = args.sides.split(",") if args.sides else default
    if unknown := [side for side in args.side_list if side not in known]:
        parser.error(f"unknown sides {unknown}; known: {','.join(known)}")
    if min(args.threads, args.steps, args.rounds) < 1 or args.warmup < 1:
        parser.error("--threads, --steps, --rounds and --warmup must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    names = list(SHAPES) if args.shape == "both" else [args.shape]
    print(f"torch {torch.__version__}, {args.threads} threads, python {sys.version.split()[0]}")
    gemm = gemm_gflops()
    print(f"fp32 GEMM rate ({GEMM_SIZE}^2 torch.mm, median of {GEMM_REPEATS}): {gemm:.2f} GFLOP/s")
    for name in names:
        run_shape(Shape(name, *SHAPES[name]), args.side_list, args, gemm)


if __name__ == "__main__":
    main()
