"""Streaming consolidation: the safetensors writer, split weight files, memory, the command."""

from __future__ import annotations

import errno
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PretrainedConfig

import meshtrain.checkpoint.consolidate.rebuild as consolidate_module
from meshtrain.checkpoint import CheckpointError, consolidate_checkpoint
from meshtrain.checkpoint.consolidate import parse_size
from meshtrain.checkpoint.files import shard_dir_name
from meshtrain.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    describe_files,
    mark_complete,
    read_manifest,
    write_json_atomic,
)
from meshtrain.checkpoint.safetensors_format import (
    SafetensorsWriter,
    TensorSpec,
    read_safetensors_header,
    save_safetensors,
)
from meshtrain.commands import main
from meshtrain.distributed import kv_heads
from meshtrain.models import build_model, build_model_config
from tests.conftest import TINY_MODEL, TINY_VOCAB

# --- helpers ---------------------------------------------------------------------------------


def _sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    low = 0 if dtype == torch.uint8 else -100
    return torch.randint(low, 100, shape, generator=generator).to(dtype)


def _header(path: Path) -> tuple[int, dict]:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return length, json.loads(handle.read(length))


def _replicate_kv(weight: torch.Tensor, copies: int, head_dim: int) -> torch.Tensor:
    """Each KV head repeated `copies` times, copies side by side (as training stores it)."""
    heads = weight.shape[0] // head_dim
    rest = weight.shape[1:]
    return (
        weight.reshape(heads, 1, head_dim, *rest)
        .expand(-1, copies, -1, *rest)
        .reshape(heads * copies * head_dim, *rest)
    )


def write_checkpoint(
    root: Path,
    full: dict[str, torch.Tensor],
    *,
    tp: int = 1,
    tp_dims: dict[str, int | None] | None = None,
    kv: dict[str, tuple[int, int]] | None = None,
    config: PretrainedConfig | None = None,
    step: int = 1,
) -> Path:
    """A complete checkpoint holding `full` split over `tp` ranks along `tp_dims`, with
    the tensors named in `kv` ({name: (copies, head_dim)}) KV-replicated first."""
    tp_dims = tp_dims or {}
    kv = kv or {}
    stored = {name: _replicate_kv(t, *kv[name]) if name in kv else t for name, t in full.items()}
    for tp_rank in range(tp):
        shard_dir = root / "shards" / shard_dir_name(tp_rank, 0)
        shard_dir.mkdir(parents=True)
        pieces = {}
        for name, tensor in stored.items():
            dim = tp_dims.get(name) if tp > 1 else None
            piece = tensor if dim is None else torch.chunk(tensor, tp, dim=dim)[tp_rank]
            pieces[name] = piece.contiguous()
        save_file(pieces, shard_dir / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        config.save_pretrained(root)
    else:
        (root / "config.json").write_text("{}\n")
    write_json_atomic(root / "trainer_state.json", {"step": step})
    tensors = {}
    for name, tensor in full.items():
        entry = {
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "tp_dim": tp_dims.get(name) if tp > 1 else None,
            "pp_rank": 0,
        }
        if name in kv:
            entry.update(kv_replication=kv[name][0], kv_head_dim=kv[name][1])
        tensors[name] = entry
    mark_complete(
        root,
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "layout": {"data_parallel_size": 1, "tensor_parallel_size": tp},
            "world_size": tp,
            "tensors": tensors,
            "files": describe_files(root),
        },
    )
    return root


def _llama_tp_dim(name: str) -> int | None:
    """Column-parallel projections, vocab-parallel embedding and head split rows;
    row-parallel projections split columns; norms are replicated."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    if name.endswith(("norm.weight",)):
        return None
    return 0


@pytest.fixture(scope="module")
def tiny_llama() -> tuple[PretrainedConfig, dict[str, torch.Tensor]]:
    config = build_model_config("llama", dict(TINY_MODEL), vocab_size=TINY_VOCAB)
    model = build_model(config, seed=0)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model.config, state


def _llama_checkpoint(root: Path, tiny_llama, tp: int) -> Path:
    config, state = tiny_llama
    kv = {}
    if tp > config.num_key_value_heads:  # fewer KV heads than ranks: replicate them
        copies = tp // config.num_key_value_heads
        head_dim = config.hidden_size // config.num_attention_heads
        kv = {
            n: (copies, head_dim) for n in state if n.endswith(("k_proj.weight", "v_proj.weight"))
        }
    tp_dims = {n: _llama_tp_dim(n) for n in state}
    return write_checkpoint(root, state, tp=tp, tp_dims=tp_dims, kv=kv, config=config, step=3)


# --- the writer -------------------------------------------------------------------------------

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (0, 4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_writer_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = {f"t{i}": _sample(shape, dtype, seed=i) for i, shape in enumerate(SHAPES)}
    path = tmp_path / "x.safetensors"
    save_safetensors(tensors, path, metadata={"format": "pt"})

    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(loaded[name], tensor), name
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        assert torch.equal(handle.get_tensor("t3"), tensors["t3"])
        assert handle.get_slice("t4").get_shape() == [2, 3, 4]
    length, _ = _header(path)
    assert (8 + length) % 8 == 0  # the data section starts 8-byte aligned


def test_writer_keeps_mixed_dtypes_aligned(tmp_path: Path) -> None:
    tensors = {
        "odd_bf16": _sample((3,), torch.bfloat16),
        "f32": _sample((5,), torch.float32),
        "i8": _sample((3,), torch.int8),
        "f64": _sample((2, 2), torch.float64),
        "f16": _sample((1, 3), torch.float16),
        "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "mixed.safetensors"
    save_safetensors(tensors, path)
    loaded = load_file(path)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name
    length, header = _header(path)
    assert "__metadata__" not in header
    codes = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I8": 1}
    end = 0
    for name, entry in header.items():
        begin, stop = entry["data_offsets"]
        assert begin == end and begin % codes[entry["dtype"]] == 0, name
        end = stop
    assert path.stat().st_size == 8 + length + end


def test_writer_takes_row_blocks_in_any_tensor_order(tmp_path: Path) -> None:
    a = _sample((10, 3), torch.float32)
    b = _sample((4,), torch.float16)
    path = tmp_path / "blocks.safetensors"
    specs = [TensorSpec("a", a.dtype, a.shape), TensorSpec("b", b.dtype, list(b.shape))]
    with SafetensorsWriter(path, specs, metadata={"format": "pt"}) as writer:
        assert writer.names == ["a", "b"]
        assert writer.write("b", b) == b.numel() * 2
        assert writer.write("a", iter([a[:4], a[4:8], a[8:]])) == a.numel() * 4
    loaded = load_file(path)
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["b"], b)


def test_writer_refuses_wrong_data(tmp_path: Path) -> None:
    specs = [TensorSpec("a", torch.float32, (2, 3)), TensorSpec("b", torch.float32, (2,))]
    with SafetensorsWriter(tmp_path / "w.safetensors", specs) as writer:
        with pytest.raises(ValueError, match="shape"):
            writer.write("a", torch.zeros(3, 2))
        with pytest.raises(ValueError, match="float16 piece"):
            writer.write("a", torch.zeros(2, 3, dtype=torch.float16))
        with pytest.raises(ValueError, match="more than its 24 bytes"):
            writer.write("a", [torch.zeros(3), torch.zeros(4)])
        with pytest.raises(ValueError, match="got 12 of its 24 bytes"):
            writer.write("a", [torch.zeros(3)])
        with pytest.raises(KeyError, match="'c' is not one of the tensors"):
            writer.write("c", torch.zeros(2))
        writer.write("a", torch.zeros(2, 3))
        with pytest.raises(ValueError, match="already written"):
            writer.write("a", torch.zeros(2, 3))
        with pytest.raises(ValueError, match=r"missing the data of \['b'\]"):
            writer.close()
    with pytest.raises(ValueError, match="repeated"):
        SafetensorsWriter(tmp_path / "r.safetensors", [specs[0], specs[0]])


# --- sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("10KB", 10_000),
        ("2GiB", 2 * 2**30),
        ("64 MiB", 64 * 2**20),
        ("5gb", 5 * 10**9),
        ("1000", 1000),
        ("123B", 123),
        (1000, 1000),
    ],
)
def test_parse_size(size: int | str, expected: int) -> None:
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["", "GB", "5 G B", "5XB", "-1GB", "1e9", "0", 0, -5, 1.5, True])
def test_parse_size_refuses(size) -> None:
    with pytest.raises(ValueError):
        parse_size(size)


# --- consolidation ----------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4], ids=["tp1", "tp2", "tp4-kv-replicated"])
def test_split_weights_load_in_transformers(tmp_path: Path, tiny_llama, tp: int) -> None:
    config, state = tiny_llama
    root = _llama_checkpoint(tmp_path / "run" / "checkpoint-3", tiny_llama, tp)
    manifest = read_manifest(root)
    assert any("kv_replication" in e for e in manifest["tensors"].values()) == (tp == 4)
    limit = 50_000  # below the 65,536-byte embedding and head: each gets a file of its own
    output = tmp_path / "hf"
    summary = consolidate_checkpoint(root, output, max_shard_size="50KB", progress=False)

    total = sum(t.numel() * t.element_size() for t in state.values())
    assert summary["total_size"] == total
    assert summary["num_tensors"] == len(state)
    files = summary["files"]
    assert len(files) > 2
    assert files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, 1 + len(files))
    ]
    assert not (output / "model.safetensors").exists()
    index = json.loads((output / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(state)
    assert sorted(set(index["weight_map"].values())) == files
    # Greedy in manifest order: the file number never goes down.
    order = [files.index(index["weight_map"][name]) for name in manifest["tensors"]]
    assert order == sorted(order)
    for file_name in files:
        names = [n for n, f in index["weight_map"].items() if f == file_name]
        with safe_open(str(output / file_name), framework="pt") as handle:
            assert sorted(handle.keys()) == sorted(names)
        size = sum(state[n].numel() * state[n].element_size() for n in names)
        assert size <= limit or len(names) == 1, file_name
    assert index["weight_map"]["model.embed_tokens.weight"] != index["weight_map"]["lm_head.weight"]

    loaded = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32)
    loaded_state = dict(loaded.named_parameters())
    assert set(loaded_state) == set(state)
    for name, tensor in state.items():
        assert torch.equal(loaded_state[name].detach(), tensor), name
    assert loaded.config.num_key_value_heads == config.num_key_value_heads


def test_a_model_that_fits_is_one_file_without_index(tmp_path: Path, tiny_llama) -> None:
    _, state = tiny_llama
    root = _llama_checkpoint(tmp_path / "checkpoint-3", tiny_llama, tp=2)
    output = tmp_path / "hf"
    summary = consolidate_checkpoint(root, output, progress=False)
    assert summary["files"] == ["model.safetensors"]
    assert sorted(p.name for p in output.glob("model*")) == ["model.safetensors"]
    merged = load_file(output / "model.safetensors")
    assert set(merged) == set(state)
    for name, tensor in state.items():
        assert torch.equal(merged[name], tensor), name
    assert (
        AutoModelForCausalLM.from_pretrained(output).num_parameters() == summary["num_parameters"]
    )


def drop_kv_copies(full: torch.Tensor, copies: int, head_dim: int, shape) -> torch.Tensor:
    """The in-memory undoing of KV-head replication, to compare the streamed one with."""
    return kv_heads.drop_kv_copies(full, copies, head_dim).reshape(shape)


def _reference(pieces: list[torch.Tensor], dim: int | None, kv: tuple[int, int] | None, shape):
    """The in-memory consolidation the streaming one must equal: cat, then drop KV copies."""
    full = pieces[0] if dim is None else torch.cat(pieces, dim=dim)
    return drop_kv_copies(full, *kv, shape) if kv else full


@pytest.mark.parametrize("chunk_bytes", [24, 1 << 24], ids=["tiny-row-blocks", "whole-tensors"])
def test_row_blocks_equal_the_in_memory_rebuild(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    """Splits along every dim, KV copies (weights and biases) spanning ranks, mixed dtypes,
    a 0-d tensor; with blocks of a few rows or whole tensors, the bytes are the same."""
    monkeypatch.setattr(consolidate_module, "CHUNK_BYTES", chunk_bytes)
    tp = 4
    full = {
        "rows": _sample((8, 6), torch.float32, 1),
        "cols": _sample((5, 8), torch.bfloat16, 2),
        "last_dim": _sample((3, 2, 8), torch.float16, 3),
        "middle_dim": _sample((3, 8, 2), torch.float32, 4),
        "k_proj.weight": _sample((2 * 3, 5), torch.float32, 5),  # 2 heads of 3 rows
        "k_proj.bias": _sample((2 * 3,), torch.bfloat16, 6),
        "norm": _sample((7,), torch.float32, 7),
        "scale": torch.tensor(0.5),
        "empty": torch.zeros(0, 4),
    }
    tp_dims = {
        "rows": 0,
        "cols": 1,
        "last_dim": 2,
        "middle_dim": 1,
        "k_proj.weight": 0,
        "k_proj.bias": 0,
        "norm": None,
        "scale": None,
        "empty": None,
    }
    kv = {"k_proj.weight": (2, 3), "k_proj.bias": (2, 3)}
    root = write_checkpoint(tmp_path / "checkpoint-1", full, tp=tp, tp_dims=tp_dims, kv=kv)
    consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    merged = load_file(tmp_path / "hf" / "model.safetensors")
    for name, tensor in full.items():
        shards = [
            load_file(root / "shards" / shard_dir_name(r, 0) / "model.safetensors")[name]
            for r in range(tp)
        ]
        expected = _reference(shards, tp_dims[name], kv.get(name), list(tensor.shape))
        assert merged[name].dtype == tensor.dtype, name
        assert torch.equal(merged[name], expected), name
        assert torch.equal(merged[name], tensor), name


def test_a_failure_leaves_no_output_and_no_partial(tmp_path: Path) -> None:
    full = {"a": _sample((4, 2), torch.float32), "b": _sample((3,), torch.float32)}
    root = write_checkpoint(tmp_path / "checkpoint-1", full, tp=2, tp_dims={"a": 1, "b": None})
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["tensors"]["a"]["shape"] = [4, 1]
    mark_complete(root, manifest)
    with pytest.raises(CheckpointError, match=r"a rebuilt with shape \[4, 2\]"):
        consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    manifest["tensors"]["a"]["shape"] = [4, 2]
    manifest["tensors"]["b"]["dtype"] = "bfloat16"
    mark_complete(root, manifest)
    with pytest.raises(CheckpointError, match="b is stored as F32, the manifest says bfloat16"):
        consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_an_output_over_the_checkpoint_is_refused(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "run" / "checkpoint-1", {"a": torch.ones(2)})
    for output in (root, root.parent, root / "shards", root / "shards" / shard_dir_name(0, 0)):
        with pytest.raises(CheckpointError, match="would replace files of the checkpoint"):
            consolidate_checkpoint(root, output, progress=False)
    assert read_manifest(root)["step"] == 1


def test_an_old_output_is_replaced_whole(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path / "checkpoint-1", {"a": torch.ones(2)})
    output = tmp_path / "hf"
    consolidate_checkpoint(root, output, max_shard_size=1, progress=False)
    (output / "stale.txt").write_text("old")
    consolidate_checkpoint(root, output, progress=False)
    assert sorted(p.name for p in output.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "hf"]


def test_the_progress_bar_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = write_checkpoint(tmp_path / "checkpoint-1", {"a": torch.ones(2), "b": torch.ones(3)})
    consolidate_checkpoint(root, tmp_path / "hf", progress=True)
    captured = capsys.readouterr()
    assert "consolidating step 1" in captured.err and "2/2 tensors" in captured.err
    assert captured.out == ""
    consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    assert capsys.readouterr() == ("", "")


# --- memory -----------------------------------------------------------------------------------

BIG_SHAPE = (2000, 5000)  # 40 MB of float32
BIG_BYTES = math.prod(BIG_SHAPE) * 4

# Peak RSS of this process only. `ru_maxrss` is carried over exec from the parent
# (Linux keeps the exec'ing image's peak), so in a child of pytest it starts at
# pytest's own peak and would hide the consolidation; VmHWM belongs to the new image.
_MEASURE = """
import json, resource, sys
from meshtrain.checkpoint import consolidate_checkpoint

def peak():
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale

before = peak()
consolidate_checkpoint(sys.argv[1], sys.argv[2], verify=False, progress=False)
print(json.dumps({"before": before, "after": peak()}))
"""


def _big_tensor(index: int) -> torch.Tensor:
    return torch.arange(BIG_SHAPE[1], dtype=torch.float32).expand(BIG_SHAPE) + index * 1000.0


def test_memory_stays_near_one_tensor(tmp_path: Path) -> None:
    """8 tensors of 40 MB over tp=2 (split rows, then columns): the peak grows by a few
    MiB of buffers, not by a tensor (rows are copied file to file, columns interleaved in
    blocks of CHUNK_BYTES), never by the 320 MB model (the in-memory version grew by over
    600 MB, the memory-mapped one by about a tensor)."""
    root = tmp_path / "checkpoint-1"
    tp = 2
    names = [f"model.layers.{i}.weight" for i in range(8)]
    for tp_rank in range(tp):
        shard_dir = root / "shards" / shard_dir_name(tp_rank, 0)
        shard_dir.mkdir(parents=True)
        piece_shape = [list(BIG_SHAPE) for _ in names]
        for i, shape in enumerate(piece_shape):
            shape[i % 2] //= tp
        specs = [TensorSpec(n, torch.float32, s) for n, s in zip(names, piece_shape, strict=True)]
        with SafetensorsWriter(shard_dir / "model.safetensors", specs) as writer:
            for i, name in enumerate(names):
                writer.write(name, torch.chunk(_big_tensor(i), tp, dim=i % 2)[tp_rank])
    (root / "config.json").write_text("{}\n")
    mark_complete(
        root,
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": 1,
            "layout": {"tensor_parallel_size": tp},
            "tensors": {
                name: {"shape": list(BIG_SHAPE), "dtype": "float32", "tp_dim": i % 2, "pp_rank": 0}
                for i, name in enumerate(names)
            },
            "files": describe_files(root),
        },
    )
    output = tmp_path / "hf"
    try:
        result = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(root), str(output)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        rss = json.loads(result.stdout.strip().splitlines()[-1])
        increase = rss["after"] - rss["before"]
        assert increase < BIG_BYTES // 4, f"peak RSS grew by {increase / 1e6:.0f} MB"
        with safe_open(str(output / "model.safetensors"), framework="pt") as handle:
            for i, name in enumerate(names):
                rows = handle.get_slice(name)[1995:]
                assert torch.equal(rows, _big_tensor(i)[1995:]), name
    finally:
        for path in (*root.rglob("*.safetensors"), *output.glob("*.safetensors")):
            path.unlink()  # 640 MB: not left to pytest's kept temporary folders


# --- the command ------------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path, tiny_llama) -> Path:
    run = tmp_path / "run"
    _llama_checkpoint(run / "checkpoint-3", tiny_llama, tp=2)
    return run


def test_cli_writes_next_to_the_shards_by_default(
    run_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["consolidate", str(run_dir)]) == 0
    checkpoint = run_dir / "checkpoint-3"
    summary = json.loads(capsys.readouterr().out)
    assert summary["output_dir"] == str(checkpoint / "consolidated")
    assert summary["files"] == ["model.safetensors"]
    assert (checkpoint / "consolidated" / "model.safetensors").is_file()
    assert (checkpoint / "consolidated" / "config.json").is_file()
    read_manifest(checkpoint)  # the new folder is not in the manifest, which still holds
    # Again, from the shards folder: the old consolidated folder is replaced.
    assert main(["consolidate", str(checkpoint / "shards"), "--no-verify"]) == 0
    assert json.loads(capsys.readouterr().out)["output_dir"] == str(checkpoint / "consolidated")


def test_cli_max_shard_size(run_dir: Path, tmp_path: Path, capsys) -> None:
    output = tmp_path / "hf"
    assert main(["consolidate", str(run_dir), str(output), "--max-shard-size", "0.1MB"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["files"]) > 1
    assert (output / "model.safetensors.index.json").is_file()
    assert (
        AutoModelForCausalLM.from_pretrained(output).num_parameters() == summary["num_parameters"]
    )


def test_cli_help_names_the_default_output(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["consolidate", "--help"])
    assert info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "[OUTPUT_DIR]" in help_text and "--max-shard-size" in help_text
    assert "default: consolidated/ inside the resolved checkpoint folder" in help_text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no complete checkpoint-<step> folder"),
        (["--max-shard-size", "5 apples"], "--max-shard-size: cannot read '5 apples'"),
    ],
)
def test_cli_errors_exit_1_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoint-1", {"a": torch.ones(2)})
    (run / "checkpoint-1" / "COMPLETE").unlink()  # half written
    assert main(["consolidate", str(run), *args]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


# --- the byte paths (no torch): interleaving, kernel copies and their fallbacks -----------------


def _shard_pieces(root: Path, name: str, tp: int) -> list[torch.Tensor]:
    return [
        load_file(root / "shards" / shard_dir_name(r, 0) / "model.safetensors")[name]
        for r in range(tp)
    ]


INTERLEAVED = {  # name: (shape, dtype, tp_dim); torch.chunk gives unequal pieces of odd sizes
    "wide_f32": ((9, 7 * 16), torch.float32, 1),
    "odd_bf16": ((13, 7), torch.bfloat16, 1),
    "odd_f16": ((5, 11), torch.float16, 1),
    "three_d_f32": ((3, 10, 5), torch.float32, 1),
    "last_dim_bf16": ((2, 3, 13), torch.bfloat16, 2),
    "wide_bf16": ((6, 4 * 201), torch.bfloat16, 1),
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("way", ["preadv-in-place", "numpy"])
@pytest.mark.parametrize("chunk_bytes", [40, 1 << 20], ids=["blocks-of-rows", "one-block"])
def test_interleaving_pieces_split_on_a_later_dim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int, way: str, chunk_bytes: int
) -> None:
    """Pieces split along dim 1 (or 2), of 2 or 4 ranks, odd and unequal widths, bf16/fp16/
    fp32: the output equals torch.cat of the pieces, read in place or via numpy, in blocks
    of a few rows (the last one short) or in one."""
    monkeypatch.setattr(consolidate_module, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(consolidate_module, "SCATTER_MIN_BYTES", 1 if way != "numpy" else 1 << 40)
    full = {
        name: _sample(shape, dtype, seed=i)
        for i, (name, (shape, dtype, _)) in enumerate(INTERLEAVED.items())
    }
    tp_dims = {name: dim for name, (_, _, dim) in INTERLEAVED.items()}
    root = write_checkpoint(tmp_path / "checkpoint-1", full, tp=tp, tp_dims=tp_dims)
    consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    merged = load_file(tmp_path / "hf" / "model.safetensors")
    unequal = set()
    for name, tensor in full.items():
        pieces = _shard_pieces(root, name, tp)
        if len({p.shape[tp_dims[name]] for p in pieces}) > 1:
            unequal.add(name)
        assert merged[name].dtype == tensor.dtype, name
        assert torch.equal(merged[name], torch.cat(pieces, dim=tp_dims[name])), name
        assert torch.equal(merged[name], tensor), name
    assert len(unequal) >= 3


@pytest.mark.parametrize(
    ("tp", "kv_heads", "copies"),
    [(4, 2, 2), (2, 1, 4), (4, 1, 4)],
    ids=["one-copy-per-rank", "copies-within-a-piece", "copies-across-all-ranks"],
)
def test_kv_copies_are_dropped_by_byte_ranges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tp: int, kv_heads: int, copies: int
) -> None:
    """Replicated KV heads (weights and biases, split on dim 0) are rebuilt by copying the
    first copy of each run of heads file to file: no interleaving, exactly the kept bytes."""
    head_dim = 3
    full = {
        "k_proj.weight": _sample((kv_heads * head_dim, 5), torch.bfloat16, 1),
        "v_proj.weight": _sample((kv_heads * head_dim, 5), torch.float32, 2),
        "k_proj.bias": _sample((kv_heads * head_dim,), torch.float16, 3),
    }
    kv = {name: (copies, head_dim) for name in full}
    root = write_checkpoint(
        tmp_path / "checkpoint-1", full, tp=tp, tp_dims=dict.fromkeys(full, 0), kv=kv
    )
    copied: list[int] = []
    real_copy = consolidate_module._ByteCopier.copy

    def spy(self, src, src_offset, dst, dst_offset, count, bar):
        copied.append(count)
        return real_copy(self, src, src_offset, dst, dst_offset, count, bar)

    def no_interleave(*args):
        raise AssertionError("a dim-0 tensor was interleaved")

    monkeypatch.setattr(consolidate_module._ByteCopier, "copy", spy)
    monkeypatch.setattr(consolidate_module, "_interleave", no_interleave)
    consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    merged = load_file(tmp_path / "hf" / "model.safetensors")
    for name, tensor in full.items():
        stored = torch.cat(_shard_pieces(root, name, tp))
        assert stored.shape[0] == kv_heads * copies * head_dim
        assert torch.equal(merged[name], drop_kv_copies(stored, copies, head_dim, tensor.shape))
        assert torch.equal(merged[name], tensor), name
    assert sum(copied) == sum(t.numel() * t.element_size() for t in full.values())
    assert len(copied) == len(full) * kv_heads  # one range per kept head


def _mixed_checkpoint(root: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    full = {
        "rows": _sample((10, 6), torch.float32, 1),
        "cols": _sample((6, 10), torch.bfloat16, 2),
        "norm": _sample((6,), torch.float32, 3),
        "scale": torch.tensor(1.5),
    }
    tp_dims = {"rows": 0, "cols": 1, "norm": None, "scale": None}
    return write_checkpoint(root, full, tp=2, tp_dims=tp_dims), full


@pytest.mark.parametrize(
    "broken", [["copy_file_range"], ["copy_file_range", "sendfile"]], ids=["sendfile", "read"]
)
def test_unsupported_kernel_copies_fall_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: list[str]
) -> None:
    """copy_file_range refused (EXDEV: another file system), then sendfile too: the same
    bytes, through sendfile or through reads and writes."""
    monkeypatch.setattr(consolidate_module, "COPY_BYTES", 16)  # many calls of odd sizes
    root, _ = _mixed_checkpoint(tmp_path / "checkpoint-1")
    consolidate_checkpoint(root, tmp_path / "reference", progress=False)
    calls = {name: 0 for name in broken}

    def refuse(name):
        def call(*args, **kwargs):
            calls[name] += 1
            raise OSError(errno.EXDEV, f"{name}: Invalid cross-device link")

        return call

    for name in broken:
        monkeypatch.setattr(consolidate_module.os, name, refuse(name), raising=False)
    consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    # Not tried again (shutil.copy2, copying config.json, tries sendfile once more).
    assert calls["copy_file_range"] == 1 and calls.get("sendfile", 1) <= 2, calls
    for path in (tmp_path / "reference").iterdir():
        assert (tmp_path / "hf" / path.name).read_bytes() == path.read_bytes(), path.name


def test_a_kernel_copy_answering_zero_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, full = _mixed_checkpoint(tmp_path / "checkpoint-1")
    monkeypatch.setattr(consolidate_module.os, "copy_file_range", lambda *a: 0, raising=False)
    consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    merged = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(merged[name], tensor) for name, tensor in full.items())


def test_other_copy_errors_are_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = _mixed_checkpoint(tmp_path / "checkpoint-1")

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(consolidate_module.os, "copy_file_range", full_disk, raising=False)
    with pytest.raises(OSError, match="No space left"):
        consolidate_checkpoint(root, tmp_path / "hf", verify=False, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_few_open_shard_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_OPEN_SHARDS, files are closed, but never the pieces of the tensor at hand."""
    monkeypatch.setattr(consolidate_module, "MAX_OPEN_SHARDS", 1)
    full = {"a": _sample((8, 4), torch.float32, 1), "b": _sample((4, 8), torch.float32, 2)}
    root = write_checkpoint(tmp_path / "checkpoint-1", full, tp=4, tp_dims={"a": 0, "b": 1})
    consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    merged = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(merged[name], tensor) for name, tensor in full.items())


# --- the sha256 check, alongside the copy ---------------------------------------------------


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["data", "header", "other-file"])
def test_a_corrupted_file_fails_the_sha256_and_leaves_no_output(tmp_path: Path, where) -> None:
    root, _ = _mixed_checkpoint(tmp_path / "checkpoint-1")
    shard = root / "shards" / shard_dir_name(1, 0) / "model.safetensors"
    if where == "data":
        _flip_byte(shard, shard.stat().st_size - 1)
    elif where == "header":
        _flip_byte(shard, 9)  # the JSON is no longer JSON: the sha256 is still the cause given
    else:
        shard = root / "trainer_state.json"
        _flip_byte(shard, 2)
    with pytest.raises(CheckpointError, match="does not match its sha256") as info:
        consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    assert str(shard) in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    if where == "header":
        with pytest.raises(CheckpointError, match="not a safetensors file"):
            consolidate_checkpoint(root, tmp_path / "hf", verify=False, progress=False)
    elif where == "data":  # unverified, the flipped byte is copied as it is
        consolidate_checkpoint(root, tmp_path / "hf", verify=False, progress=False)


# --- the safetensors header reader ---------------------------------------------------------


def test_header_reader_finds_every_tensor(tmp_path: Path) -> None:
    tensors = {"a": _sample((3, 5), torch.bfloat16), "b": _sample((2,), torch.int64)}
    path = tmp_path / "x.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    found = read_safetensors_header(path)
    raw = path.read_bytes()
    for name, tensor in tensors.items():
        entry = found[name]
        assert entry.shape == tuple(tensor.shape) and entry.nbytes == tensor.nbytes
        piece = raw[entry.start : entry.start + entry.nbytes]
        assert piece == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name
    assert found["a"].code == "BF16" and found["b"].code == "I64"


def _raw_safetensors(header: bytes | dict, data: bytes = b"", length: int | None = None) -> bytes:
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(encoded) if length is None else length) + encoded + data


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x01\x00", "is not a safetensors file"),
        (_raw_safetensors({}, length=1 << 40), "header in"),
        (_raw_safetensors(b"{nope"), "not JSON"),
        (_raw_safetensors(b"[1, 2]"), "not an object"),
        (_raw_safetensors({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}), "t is"),
        (_raw_safetensors({"t": {"dtype": "F32", "shape": [3]}}, b"\0" * 12), "t is not valid"),
        (_raw_safetensors({"t": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}, b"1"), "t"),
        (
            _raw_safetensors(
                {"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"1" * 12
            ),
            "t is not valid",
        ),
    ],
)
def test_header_reader_refuses_malformed_files(tmp_path: Path, content: bytes, message) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        read_safetensors_header(path)


def test_writer_takes_dtype_names(tmp_path: Path) -> None:
    """Specs with dtype names ("bfloat16") or torch dtypes write the same file."""
    tensors = {"a": _sample((3, 2), torch.bfloat16), "b": _sample((5,), torch.float32)}
    save_safetensors(tensors, tmp_path / "torch.safetensors")
    specs = [
        TensorSpec(n, str(t.dtype).removeprefix("torch."), t.shape) for n, t in tensors.items()
    ]
    with SafetensorsWriter(tmp_path / "names.safetensors", specs) as writer:
        for name in writer.names:
            writer.write(name, tensors[name])
    assert (tmp_path / "names.safetensors").read_bytes() == (
        tmp_path / "torch.safetensors"
    ).read_bytes()
    with pytest.raises(ValueError, match="no code for dtype torch.complex64"):
        SafetensorsWriter(tmp_path / "c.safetensors", [TensorSpec("c", torch.complex64, (1,))])


# --- the command's imports --------------------------------------------------------------------

_NO_TORCH = """
import json, sys
from meshtrain.commands import main
code = main(["consolidate", *sys.argv[1:]])
heavy = ("torch", "safetensors", "transformers", "numpy")
print(json.dumps({"code": code, "imported": [m for m in heavy if m in sys.modules]}))
"""


def test_the_command_imports_no_torch(tmp_path: Path, tiny_llama) -> None:
    """`python -m meshtrain consolidate` moves bytes: torch, safetensors and transformers
    are never imported (and numpy only for split rows under SCATTER_MIN_BYTES)."""
    llama = _llama_checkpoint(tmp_path / "run" / "checkpoint-3", tiny_llama, tp=4)
    wide = write_checkpoint(
        tmp_path / "wide" / "checkpoint-1",
        {"cols": _sample((3, 512), torch.bfloat16), "rows": _sample((8, 3), torch.float32)},
        tp=2,
        tp_dims={"cols": 1, "rows": 0},
    )
    for root, extra, allowed in ((llama, [], {"numpy"}), (wide, ["--no-verify"], set())):
        result = subprocess.run(
            [sys.executable, "-c", _NO_TORCH, str(root), str(tmp_path / "out"), *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["code"] == 0, result.stderr
        assert set(report["imported"]) <= allowed, report
        assert (tmp_path / "out" / "model.safetensors").is_file()


def test_cli_dtype_casts_while_streaming_and_the_model_loads(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--dtype bf16 (several files, so both the copied and the interleaved tensors are
    cast): every tensor is the fp32 one rounded as torch rounds, config.json says bf16."""
    fp32_dir, bf16_dir = tmp_path / "fp32", tmp_path / "bf16"
    assert main(["consolidate", str(run_dir), str(fp32_dir)]) == 0
    capsys.readouterr()
    args = ["consolidate", str(run_dir), str(bf16_dir), "--dtype", "bf16"]
    assert main([*args, "--max-shard-size", "0.1MB"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dtype"] == ["bfloat16"] and len(summary["files"]) > 1
    want = load_file(fp32_dir / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(bf16_dir)
    assert model.dtype == torch.bfloat16
    got = dict(model.named_parameters())
    for name, tensor in want.items():
        if name in got:
            assert torch.equal(got[name].detach(), tensor.to(torch.bfloat16)), name
    assert json.loads((bf16_dir / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli_refuses_a_dtype_it_cannot_cast_to(run_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["consolidate", str(run_dir), str(tmp_path / "out"), "--dtype", "int8"]) == 1
    error = capsys.readouterr().err
    assert "--dtype" in error and "bfloat16 (bf16)" in error
    assert not (tmp_path / "out").exists()


def test_casts_match_torch_bitwise_ties_and_specials_included() -> None:
    from meshtrain.checkpoint.consolidate.convert import caster  # noqa: PLC0415

    generator = torch.Generator().manual_seed(0)
    values = torch.randn(10_000, generator=generator) * 10.0 ** torch.randint(-30, 30, (10_000,))
    # Exact ties between two bf16 values (round to even), extremes, zeros, infinities.
    ties = torch.tensor([1.00390625, 1.01171875, -1.00390625, 3.3895314e38, 1e-45, -0.0, 0.0])
    specials = torch.tensor([float("inf"), -float("inf"), torch.finfo(torch.float32).max])
    values = torch.cat([values, ties, specials])
    to_bf16 = caster("float32", "bfloat16")
    raw = to_bf16(memoryview(values.numpy().tobytes()))
    got = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16)
    assert torch.equal(got.view(torch.int16), values.to(torch.bfloat16).view(torch.int16))
    back = caster("bfloat16", "float32")(memoryview(bytes(raw)))
    assert torch.equal(torch.frombuffer(bytearray(back), dtype=torch.float32), got.float())
    nan = caster("float32", "bfloat16")(memoryview(torch.tensor([float("nan")]).numpy().tobytes()))
    assert torch.frombuffer(bytearray(nan), dtype=torch.bfloat16).isnan().all()
    assert caster("float32", "float32") is None
