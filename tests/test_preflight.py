"""The pieces behind refusing before any work: the host's memory and cores against the
plan, the data pipeline's staged folders, advice that differs from the layout refused,
and library errors turned into refusals that name the parameter and the file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import datasets
import pytest

from meshtrain.config import ConfigError, RunConfig
from meshtrain.data.corpus import CorpusError, load_corpus
from meshtrain.data.packing import tokenize_and_pack
from meshtrain.data.tokenizer import train_tokenizer
from meshtrain.models import build_model_config
from meshtrain.pipelines.catalog_io import HFDiskDataset, TokenizerDataset
from meshtrain.planner import LayoutError
from meshtrain.planner.host import GIB, Host, check_host, snapshot_bytes
from meshtrain.planner.search import plan_run


def _plan(**groups):
    run = RunConfig.from_params(**groups)
    config = build_model_config("llama", run.model.config, vocab_size=1024)
    return plan_run(run, config, num_train_blocks=10_000, num_validation_blocks=100)


DEFAULT_MODEL = {
    "config": {
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
}


def test_ranks_that_outgrow_the_host_are_refused_with_the_arithmetic():
    plan = _plan(launch={"nproc_per_node": 64}, model=DEFAULT_MODEL)
    per_rank = plan.memory_estimate_per_rank["process_total"]
    host = Host(memory_bytes=24 * GIB, memory_source="MemAvailable in /proc/meminfo", cores=2)
    with pytest.raises(LayoutError) as refused:
        check_host(plan, 64, host)
    message = str(refused.value)
    assert "launch.nproc_per_node=64" in message
    assert f"64 ranks x {per_rank / GIB:.2f} GiB per rank" in message
    assert f"= {64 * per_rank / GIB:.1f} GiB" in message and "24.0 GiB" in message
    assert f"launch.nproc_per_node<={24 * GIB // per_rank}" in message
    assert len(message.splitlines()) <= 3


def test_the_default_run_fits_and_more_ranks_than_cores_is_a_warning():
    plan = _plan(model=DEFAULT_MODEL)
    assert check_host(plan, 2, Host(24 * GIB, "test", cores=2)) == []
    warnings = check_host(plan, 2, Host(24 * GIB, "test", cores=1))
    assert len(warnings) == 1 and "launch.nproc_per_node=2 ranks share 1 core" in warnings[0]
    assert "docs/speed.md" in warnings[0]
    assert Host.here().cores >= 1 and Host.here().memory_bytes > 0


def test_background_checkpoints_that_only_fit_without_their_snapshots_are_refused():
    plan = _plan(launch={"nproc_per_node": 4}, model=DEFAULT_MODEL)
    per_rank = plan.memory_estimate_per_rank["process_total"]
    snapshot = snapshot_bytes(plan)
    assert 0 < snapshot < per_rank
    roomy = Host(int(4 * (per_rank + snapshot)) + 1, "test", cores=4)
    assert check_host(plan, 4, roomy, snapshot=True) == []
    tight = Host(int(4 * per_rank) + 1, "test", cores=4)
    assert check_host(plan, 4, tight) == []  # synchronous saves hold no copy
    with pytest.raises(LayoutError) as refused:
        check_host(plan, 4, tight, snapshot=True)
    message = str(refused.value)
    assert "training.checkpoint_async" in message
    assert "Set training.checkpoint_async=false" in message
    assert f"4 x {snapshot / GIB:.2f} GiB" in message


def test_on_accelerators_the_host_holds_the_offloaded_activations():
    model = {"config": {**DEFAULT_MODEL["config"], "hidden_size": 1024}}
    groups = {
        "model": model,
        "launch": {"nproc_per_node": 8},
        "planner": {"device": "h100"},
        "training": {"per_device_train_batch_size": 8},
        "data": {"block_size": 512},
    }
    # As planned for a GPU cluster (here, without CUDA, the plan's backend is gloo).
    kept = dataclasses.replace(_plan(**groups), backend="nccl")
    offloaded = _plan(parallel={"activation_offloading": True}, **groups)
    offloaded = dataclasses.replace(offloaded, backend="nccl")
    moved = offloaded.memory_estimate_per_rank["offloaded_to_host"]
    assert "offloaded_to_host" not in kept.memory_estimate_per_rank
    device = kept.memory_estimate_per_rank["activations"]
    assert 0.5 * device < moved <= device
    per_rank = 0.5 * GIB + moved  # the process's own share, at a CPU worker's measured one
    assert check_host(offloaded, 8, Host(int(8 * per_rank) + 1, "test", cores=1)) == []
    with pytest.raises(LayoutError, match=r"8 ranks x [\d.]+ GiB per rank \(the process and"):
        check_host(offloaded, 8, Host(int(8 * per_rank) - 1, "test", cores=1))


def test_over_memory_advice_leaves_out_what_the_layout_already_does():
    big = {"config": {**DEFAULT_MODEL["config"], "hidden_size": 4096, "num_hidden_layers": 32}}
    groups = {
        "model": big,
        "launch": {"nproc_per_node": 2},
        "planner": {"device": "cpu"},
        "training": {"per_device_train_batch_size": 1},
    }
    fixed = {
        "data_parallel_size": 2,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "sharded_data_parallel_degree": 2,
        "activation_checkpointing": "selective",
    }
    with pytest.raises(LayoutError) as refused:
        _plan(parallel=fixed, **groups)
    message = str(refused.value)
    assert "activation_checkpointing=full" in message
    assert "selective or full" not in message and "sharded data parallelism" not in message
    assert "per_device_train_batch_size" not in message  # already 1
    with pytest.raises(LayoutError) as refused:
        _plan(parallel={**fixed, "sharded_data_parallel_degree": 1, "zero_1": False}, **groups)
    message = str(refused.value)
    assert "ZeRO-1" in message and "sharded data parallelism" in message


def _blocks() -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": ["one document", "another one"]})


@pytest.mark.parametrize("kind", ["blocks", "tokenizer"])
def test_a_staged_folder_leaves_the_old_one_until_committed(tmp_path: Path, kind: str):
    old_tokenizer = train_tokenizer(_blocks(), 300)
    place = tmp_path / "folder"
    if kind == "blocks":
        dataset, first, second = HFDiskDataset(str(place)), _blocks(), _blocks().select([1])

        def read(blocks):
            return blocks["text"]
    else:
        dataset, first = TokenizerDataset(str(place)), old_tokenizer
        second = train_tokenizer(datasets.Dataset.from_dict({"text": ["zzz qqq"] * 9}), 290)

        def read(tokenizer):
            return sorted(tokenizer.get_vocab().items())

    assert read(first) != read(second)
    dataset.save(first)
    dataset.commit()
    before = {p: p.read_bytes() for p in sorted(place.rglob("*")) if p.is_file()}
    (place / "cache-kept.arrow").write_bytes(b"a datasets cache file")
    before[place / "cache-kept.arrow"] = b"a datasets cache file"

    dataset.save(second)  # staged beside: later nodes read it, the old folder is as it was
    assert read(dataset.load()) == read(second)
    assert {p: p.read_bytes() for p in sorted(place.rglob("*")) if p.is_file()} == before
    dataset.discard()  # the run was refused: nothing of it is left
    assert not place.with_name("folder.staged").exists()
    assert read(dataset.load()) == read(first)

    dataset.save(second)
    dataset.commit()  # the run got past its checks
    assert read(dataset.load()) == read(second)
    assert not (place / "cache-kept.arrow").exists()
    assert not place.with_name("folder.staged").exists()


def test_a_file_of_nul_bytes_is_refused_naming_it(tmp_path: Path):
    good = tmp_path / "good.txt"
    good.write_text("First paragraph.\n\nSecond paragraph.\n")
    bad = tmp_path / "zeros.txt"
    bad.write_bytes(b"text first " + b"\0" * 4096)
    with pytest.raises(CorpusError) as refused:
        load_corpus("text_files", text_files=[str(tmp_path / "*.txt")])
    assert f"data.text_files: {bad} is not UTF-8 text (byte 11 " in str(refused.value)


def test_a_block_longer_than_the_corpus_is_refused_with_a_size_that_works():
    corpus = datasets.Dataset.from_dict({"text": [f"document {i} " * 20 for i in range(20)]})
    tokenizer = train_tokenizer(corpus, 300)
    with pytest.raises(ConfigError) as refused:
        tokenize_and_pack(
            corpus, tokenizer, block_size=100_000_000, validation_fraction=0.1, seed=0
        )
    message = str(refused.value)
    assert message.startswith("`data.block_size=100000000` is longer than the ")
    assert "use data.block_size<=" in message


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"loss_on": "assistant"}, ("data.loss_on=assistant", "data.source=builtin")),
        (
            {"source": "hub", "hub_dataset": "a/b", "format": "text", "loss_on": "assistant"},
            ("data.loss_on=assistant", "data.format=text"),
        ),
        (
            {"source": "builtin_instructions", "loss_on": "completion"},
            ("data.loss_on=completion", "data.source=builtin_instructions"),
        ),
        ({"truncation": "off"}, ("data.truncation=off", "data.packing=auto")),
    ],
)
def test_a_data_setting_the_format_makes_meaningless_is_refused_naming_both(data, names):
    """`data.loss_on=assistant` on the builtin text corpus used to train every token with
    rc 0: refused when the run's parameters are read, naming both settings and what works."""
    with pytest.raises(ConfigError) as refused:
        RunConfig.from_params(data=data)
    message = str(refused.value)
    assert all(name in message for name in names), message
    assert "Use data." in message or "use data." in message or "leave data." in message


@pytest.mark.parametrize(
    "data",
    [
        {"loss_on": "all"},
        {"packing": "bfd", "truncation": "truncate"},
        {"source": "builtin_instructions", "loss_on": "assistant", "packing": "bfd"},
        {"source": "hub", "hub_dataset": "a/b", "loss_on": "completion"},  # format from columns
        {"source": "files", "data_files": ["a.jsonl"], "format": "prompt_completion"},
    ],
)
def test_data_settings_that_fit_the_format_pass(data):
    RunConfig.from_params(data=data)
