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
fusion: `addmm_` straight into the flat view) would have to win back.

    .venv/bin/python bench/grad_accumulation.py --shape 110m   # ~3 min
    .venv/bin/python bench/grad_accumulation.py --shape 27m    # ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from shapes import SHAPES, hf_fields
from transformers import LlamaConfig, LlamaForCausalLM

SIDES = ("grad None (bare loop)", "flat buffer views (meshtrain)", "grad None again (A/A)")


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

    def step(side: str) -> float:
        if side.startswith("flat"):
            flat.zero_()
            for p, view in zip(parameters, views, strict=True):
                p.grad = view
        else:
            for p in parameters:
                p.grad = None
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        return time.perf_counter() - started

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
    print(f"A/A: {statistics.median(times[SIDES[2]]) / base:.3f}x the time")


if __name__ == "__main__":
    main()
