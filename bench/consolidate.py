"""Consolidation of a large sharded checkpoint: peak memory and time, side by side.

Builds a synthetic meshtrain checkpoint (random weights of a Llama-shaped
model, about 2 GB in fp32, saved as tp=4 x pp=2 shards with a real
manifest), then consolidates it three ways, each in a fresh process:

* meshtrain: `python -m meshtrain consolidate` (streams tensor by tensor),
* naive: load every shard into one state dict, concatenate, save one file,
* copy: `cp -r` of the same bytes (the floor any method pays to read and write them),

and prints seconds and peak resident memory of each, as ratios. Run:

    .venv/bin/python bench/consolidate.py            # ~2 GB, a couple of minutes
    .venv/bin/python bench/consolidate.py --layers 2  # smaller, quicker
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from meshtrain.checkpoint.files import shard_dir_name
from meshtrain.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    describe_files,
    mark_complete,
)
from meshtrain.models import build_model_config, parameter_shapes
from meshtrain.models.llama.parameter_names import tensor_parallel_dim
from meshtrain.planner.checks import balanced_split

# The dimension the Llama tensor-parallel plan splits each tensor along.
split_dim = tensor_parallel_dim


def stage_of(name: str, layer_stage: list[int], pp: int) -> int:
    if "layers." in name:
        return layer_stage[int(name.split("layers.")[1].split(".")[0])]
    return 0 if "embed_tokens" in name else pp - 1


def build_checkpoint(root: Path, args: argparse.Namespace) -> int:
    """Write a complete synthetic checkpoint; returns its tensor bytes."""
    config = build_model_config(
        "llama",
        {
            "hidden_size": args.hidden,
            "intermediate_size": args.intermediate,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads,
        },
        vocab_size=args.vocab,
    )
    shapes = parameter_shapes(config)
    split = balanced_split(args.layers, args.pp)
    layer_stage = [s for s, count in enumerate(split) for _ in range(count)]
    generator = torch.Generator().manual_seed(0)
    entries, total = {}, 0
    for pp_rank in range(args.pp):
        names = [n for n in shapes if stage_of(n, layer_stage, args.pp) == pp_rank]
        pieces: dict[int, dict[str, torch.Tensor]] = {r: {} for r in range(args.tp)}
        for name in names:
            full = torch.randn(shapes[name], generator=generator)
            total += full.numel() * 4
            dim = split_dim(name)
            for r in range(args.tp):
                part = full if dim is None else torch.chunk(full, args.tp, dim=dim)[r]
                pieces[r][name] = part.contiguous()
            entries[name] = {
                "shape": list(shapes[name]),
                "dtype": "float32",
                "tp_dim": dim,
                "pp_rank": pp_rank,
            }
            del full
        for r, tensors in pieces.items():
            folder = root / "shards" / shard_dir_name(r, pp_rank)
            folder.mkdir(parents=True)
            save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(root)
    layout = {"data_parallel_size": 1, "tensor_parallel_size": args.tp,
              "pipeline_parallel_size": args.pp}  # fmt: skip
    mark_complete(
        root,
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": 1,
            "layout": layout,
            "world_size": args.tp * args.pp,
            "tensors": entries,
            "files": describe_files(root),
        },
    )
    return total


NAIVE = textwrap.dedent(
    """
    import json, sys, torch
    from pathlib import Path
    from safetensors.torch import load_file, save_file
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    manifest = json.loads((root / "manifest.json").read_text())
    tp = manifest["layout"]["tensor_parallel_size"]
    loaded = {p.parent.name: load_file(p) for p in (root / "shards").glob("*/model.safetensors")}
    state = {}
    for name, meta in manifest["tensors"].items():
        parts = [loaded[f"tp_rank_{r:02d}_pp_rank_{meta['pp_rank']:02d}"][name] for r in range(tp)]
        state[name] = parts[0] if meta["tp_dim"] is None else torch.cat(parts, meta["tp_dim"])
    out.mkdir(parents=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    """
)


def measure(command: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of a command run in a fresh process."""
    wrapper = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", wrapper, *command], check=True, capture_output=True, text=True
    )
    return time.perf_counter() - start, int(done.stdout.strip()) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="meshtrain-bench-consolidate-"))
    checkpoint = work / "checkpoint-1"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    total = build_checkpoint(checkpoint, args)
    largest = max(
        math.prod(meta["shape"]) * 4
        for meta in json.loads((checkpoint / "manifest.json").read_text())["tensors"].values()
    )
    print(
        f"synthetic checkpoint: {total / 1e9:.2f} GB of tensors in tp={args.tp} x pp={args.pp} "
        f"shards, largest tensor {largest / 2**20:.0f} MiB, built in "
        f"{time.perf_counter() - started:.0f}s"
    )

    python = sys.executable
    methods = {
        "meshtrain": lambda out: [python, "-m", "meshtrain", "consolidate", str(checkpoint),
                                  str(out), "--no-verify"],
        "meshtrain+verify": lambda out: [python, "-m", "meshtrain", "consolidate",
                                         str(checkpoint), str(out)],
        "naive": lambda out: [python, "-c", NAIVE, str(checkpoint), str(out)],
        "copy (cp -r)": lambda out: ["cp", "-r", str(checkpoint / "shards"), str(out)],
    }  # fmt: skip
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    for repeat in range(args.repeats):
        order = list(methods) if repeat % 2 == 0 else list(reversed(methods))
        for name in order:
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            results[name].append(measure(methods[name](out)))
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(work / "out.partial", ignore_errors=True)

    best = {
        name: (min(s for s, _ in runs), max(m for _, m in runs)) for name, runs in results.items()
    }
    naive_rss, copy_seconds = best["naive"][1], best["copy (cp -r)"][0]
    print(f"\n{'method':<18}{'seconds':>9}{'peak RSS MiB':>14}{'RSS / naive':>13}{'time / cp':>11}")
    for name, (seconds, rss) in best.items():
        print(
            f"{name:<18}{seconds:>9.1f}{rss:>14.0f}{rss / naive_rss:>13.2f}"
            f"{seconds / copy_seconds:>11.2f}"
        )
    print(f"\n(best of {args.repeats} runs, alternating order; RSS is the largest seen)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
