"""Peak resident memory per rank at start-up and over a short run: meta-device start-up
against every rank building the whole model first, side by side in one invocation.

The 428M-parameter Llama of issue #14 (hidden 1536, 16 layers, 16 heads, 8 KV heads,
intermediate 4096, vocab 4096) on 8 ranks, tp 4 x pp 2, 2 steps, sequence 256:

* `full-build`: what meshtrain did before: every rank builds the whole fp32 model (random
  init, or `from_pretrained`), then cuts out its stages and shards;
* `meta`: the model is built on the meta device; each rank allocates only its own shards
  and fills them from the seeded init or from its slices of the checkpoint;
* both again from `init_from` a folder of the same model in several safetensors files.

Each rank's peak resident set size is the kernel's (VmHWM of /proc/self/status: what
the machine feels, not a count of tensors), read after the model and optimizer are
built and at the end of the run; the planner's per-rank estimate stands beside it.

    .venv/bin/python bench/startup_memory.py [--steps 2] [--sides meta,full-build]

Prints a table and the ratios; asserts nothing. About 4 minutes on 2 cores, 18 GB
of memory at the peak (the full-build side).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import torch  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from meshtrain.config import LaunchConfig, RunConfig  # noqa: E402
from meshtrain.data.blocks import arrow_files  # noqa: E402
from meshtrain.launch.elastic import run_workers  # noqa: E402
from meshtrain.launch.job import make_worker_spec  # noqa: E402
from meshtrain.models import build_model, build_model_config  # noqa: E402
from meshtrain.planner import plan_run  # noqa: E402

SHAPE = {
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 512,
}
VOCAB, BLOCK, WORLD = 4096, 256, 8
PARALLEL = {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}
MIB = 2**20


def _full_build(self: Any) -> Any:
    """The start-up before meta-device building: the whole model on every rank."""
    from functools import partial  # noqa: PLC0415

    from meshtrain.models import config_from_dict  # noqa: PLC0415
    from meshtrain.models.llama.parallelize import parallelize  # noqa: PLC0415

    config = config_from_dict(self.plan.model_config)
    model = build_model(config, seed=self.cfg.seed, init_from=self.run.model.init_from)
    autocast = partial(torch.autocast, device_type="cpu", enabled=False)
    pm = parallelize(model, self.dims, self.layout, self.device, autocast)
    pm.set_training(True)
    return pm


@record
def entry(specs: list[Any], side: str) -> list[Any]:
    import meshtrain.trainer  # noqa: PLC0415
    from meshtrain.launch.worker import worker_main_sequence  # noqa: PLC0415

    if side == "full-build":
        meshtrain.trainer.Trainer._build_model = _full_build
    return worker_main_sequence(specs)


def _blocks(out: Path, count: int):
    import datasets  # noqa: PLC0415

    ids = torch.randint(0, VOCAB, (count, BLOCK), generator=torch.Generator().manual_seed(0))
    blocks = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"input_ids": ids[:-4].int().tolist()}),
            "validation": datasets.Dataset.from_dict({"input_ids": ids[-4:].int().tolist()}),
        }
    )
    blocks.save_to_disk(str(out))
    return datasets.load_from_disk(str(out))


def _spec(blocks, root: Path, steps: int, init_from: str | None):
    model = {"architecture": "llama", "config": SHAPE, "init_from": init_from}
    run = RunConfig.from_params(
        parallel=PARALLEL,
        training={
            "per_device_train_batch_size": 2,
            "max_steps": steps,
            "warmup_steps": 1,
            "eval_batches": 0,
            "checkpoint_every": 10_000,
            "keep_last": 1,
            "output_dir": str(root / "runs"),
        },
        launch={"nproc_per_node": WORLD},
        model=model,
        data={"block_size": BLOCK},
    )
    config = build_model_config("llama", SHAPE, vocab_size=VOCAB, init_from=init_from)
    plan = plan_run(
        run,
        config,
        num_train_blocks=len(blocks["train"]),
        num_validation_blocks=len(blocks["validation"]),
        cuda_available=False,
    )
    spec = make_worker_spec(
        run,
        plan,
        train_files=arrow_files(blocks["train"]),
        validation_files=[],
        tokenizer_dir=None,
    )
    return spec, plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sides", default="meta,full-build")
    parser.add_argument("--no-init-from", action="store_true", help="random init only")
    args = parser.parse_args()
    sides = args.sides.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        blocks = _blocks(root / "blocks", 2 * (args.steps + 2) + 4)
        sources: list[str | None] = [None]
        if not args.no_init_from:
            folder = root / "pretrained"
            config = build_model_config("llama", SHAPE, vocab_size=VOCAB)
            build_model(config, seed=1).save_pretrained(folder, max_shard_size="200MB")
            print(f"saved the model to {len(list(folder.glob('*.safetensors')))} files")
            sources.append(str(folder))
        for source in sources:
            for side in sides:
                spec, plan = _spec(blocks, root, args.steps, source)
                spec = dataclasses.replace(spec, run_dir=str(root / "runs" / side))
                launch = LaunchConfig(nproc_per_node=WORLD)
                name = f"{side}{' init_from' if source else ''}"
                print(f"== {name}", flush=True)
                (summary,) = run_workers(
                    entry, ([spec], side), launch, log_dir=root / "logs" / name, run_id=name
                )[0]
                rows.append((name, summary, plan))
    _report(rows)


def _report(rows: list[tuple[str, dict, Any]]) -> None:
    header = f"{'side':<22}{'start-up peak MiB':>20}{'run peak MiB':>16}{'planner MiB':>14}"
    print(f"\n{header}")
    peaks = {}
    for name, summary, plan in rows:
        startup = max(summary["startup_peak_rss_mb_per_rank"])
        run = max(summary["peak_rss_mb_per_rank"])
        predicted = plan.memory_estimate_per_rank["process_total"] / MIB
        peaks[name] = run
        print(
            f"{name:<22}{startup:>20,.0f}{run:>16,.0f}{predicted:>14,.0f}"
            f"   measured / planner {run / predicted:.2f}"
        )
        print(f"{'':<22}per rank: {[round(x) for x in summary['peak_rss_mb_per_rank']]}")
    for source in ("", " init_from"):
        meta, full = peaks.get(f"meta{source}"), peaks.get(f"full-build{source}")
        if meta and full:
            print(f"full-build / meta run peak{source}: {full / meta:.2f}x")


if __name__ == "__main__":
    main()
