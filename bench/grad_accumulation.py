"""What accumulating gradients into a flat buffer costs the backward, side by side.

meshtrain's flat buffer (`distributed/flat_buffer.py`) makes every parameter's
`.grad` a view into one contiguous gradient tensor, so autograd adds each new
weight gradient into it in place: one more pass over the gradients, and a
fresh temporary per weight every step. A bare loop leaves `.grad` None before
the backward, and autograd keeps the new gradient tensor as it is. This
script times forward + backward of one Llama shape both ways in one process,
interleaved (the order flips every round), with the first way run twice as
the A/A control, and prints the ratios. It measures the room that fusing the
weight-gradient GEMM into the buffer (Megatron's gradient accumulation
fusion: `addmm_` straight into the flat view) would have to win back, and
measures that fusion too: a third side runs every `nn.Linear` through an autograd
function whose backward adds the weight gradient into its flat view with one
`addmm_` (C = A B + C) and returns none, so autograd never accumulates it. The
fused gradients are checked equal to autograd's first.

    .venv/bin/python bench/grad_accumulation.py --shape 110m   # ~3 min
    .venv/bin/python bench/grad_accumulation.py --shape 27m    # ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from shapes import SHAPES, hf_fields
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

SIDES = (
    "grad None (bare loop)",
    "flat buffer views (meshtrain)",
    "addmm_ into the views (fusion)",
    "grad None again (A/A)",
)


class LinearIntoView(torch.autograd.Function):
    """y = x W^T; the backward adds dL/dW into `view` by one addmm_ and returns none."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, view: torch.Tensor):
        ctx.save_for_backward(x, weight)
        ctx.view = view
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        ctx.view.addmm_(rows.t(), x.reshape(-1, x.shape[-1]))
        return grad_out @ weight, None, None


def build(name: str) -> LlamaForCausalLM:
    """The preset's Llama in fp32, seeded."""
    config = LlamaConfig(**hf_fields(name), vocab_size=SHAPES[name]["vocab"])
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def flat_views(parameters: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    flat = torch.zeros(sum(p.numel() for p in parameters))
    views, offset = [], 0
    for p in parameters:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return flat, views


def route_linears(model: nn.Module, view_of: dict[int, torch.Tensor], fused: bool) -> None:
    """Every bias-free `nn.Linear` through `LinearIntoView` (fused) or its own forward."""
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        if fused:
            view = view_of[id(module.weight)]
            module.forward = lambda x, m=module, v=view: LinearIntoView.apply(x, m.weight, v)
        else:
            module.__dict__.pop("forward", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["27m", "110m"], default="110m")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    model = build(args.shape)
    parameters = list(model.parameters())
    flat, views = flat_views(parameters)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["block"]))

    view_of = {id(p): view for p, view in zip(parameters, views, strict=True)}
    linear_weights = {id(m.weight) for m in model.modules() if type(m) is nn.Linear}

    def step(side: str) -> float:
        fused = side == SIDES[2]
        route_linears(model, view_of, fused)
        if side in SIDES[1:3]:
            flat.zero_()
            for p, view in zip(parameters, views, strict=True):
                p.grad = None if fused and id(p) in linear_weights else view
        else:
            for p in parameters:
                p.grad = None
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        return time.perf_counter() - started

    step(SIDES[0])
    expected = [p.grad.clone() for p in parameters]
    step(SIDES[2])
    for p, view, grad in zip(parameters, views, expected, strict=True):
        torch.testing.assert_close(view if p.grad is None else p.grad, grad, rtol=1e-4, atol=1e-6)
    for side in SIDES:  # warm-up: allocator and kernels
        step(side)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for round_ in range(args.rounds):
        for side in SIDES if round_ % 2 == 0 else tuple(reversed(SIDES)):
            times[side].append(step(side))
    print(
        f"Llama --shape {args.shape}: {sum(p.numel() for p in parameters):,} parameters, "
        f"batch {shape['batch']} x {shape['block']}, {args.threads} thread(s), "
        f"{args.rounds} interleaved rounds; forward + backward, s"
    )
    for side, values in times.items():
        cells = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {side:<32} {cells}  median {statistics.median(values):.3f}")
    base = statistics.median(times[SIDES[0]])
    print(f"flat / grad None: {statistics.median(times[SIDES[1]]) / base:.3f}x the time")
    print(f"fusion / grad None: {statistics.median(times[SIDES[2]]) / base:.3f}x the time")
    print(f"A/A: {statistics.median(times[SIDES[3]]) / base:.3f}x the time")


if __name__ == "__main__":
    main()
