"""Streaming consolidation: memory bound (pre-check against the old implementation)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from meshtrain.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    describe_files,
    mark_complete,
    shard_dir_name,
)

BIG_SHAPE = [2000, 5000]  # 40 MB of float32
BIG_BYTES = BIG_SHAPE[0] * BIG_SHAPE[1] * 4


def _big_tensor(index: int) -> torch.Tensor:
    return torch.arange(BIG_SHAPE[1], dtype=torch.float32).expand(BIG_SHAPE) + index * 1000.0


def test_memory(tmp_path: Path) -> None:
    root = tmp_path / "checkpoint-1"
    tp = 2
    names = [f"model.layers.{i}.weight" for i in range(8)]
    for tp_rank in range(tp):
        shard_dir = root / "shards" / shard_dir_name(tp_rank, 0)
        shard_dir.mkdir(parents=True)
        pieces = {
            name: torch.chunk(_big_tensor(i), tp, dim=i % 2)[tp_rank].contiguous()
            for i, name in enumerate(names)
        }
        save_file(pieces, shard_dir / "model.safetensors", metadata={"format": "pt"})
        del pieces
    (root / "config.json").write_text("{}")
    mark_complete(
        root,
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": 1,
            "layout": {"tensor_parallel_size": tp},
            "tensors": {
                name: {"shape": BIG_SHAPE, "dtype": "float32", "tp_dim": i % 2, "pp_rank": 0}
                for i, name in enumerate(names)
            },
            "files": describe_files(root),
        },
    )
    script = (
        "import json, resource, sys\n"
        "from meshtrain.checkpoint import consolidate_checkpoint\n"
        "def hwm():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmHWM'): return int(line.split()[1]) * 1024\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "hb = hwm()\n"
        "consolidate_checkpoint(sys.argv[1], sys.argv[2], verify=False)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'before': before * 1024, 'after': after * 1024, 'hb': hb, 'ha': hwm()}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(root), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        check=True,
    )
    rss = json.loads(result.stdout.strip().splitlines()[-1])
    increase = rss["after"] - rss["before"]
    print(rss)
    print(f"peak RSS increase {increase / 2**20:.0f} MiB")
    assert increase < 3 * BIG_BYTES, f"{increase / 2**20:.0f} MiB"
