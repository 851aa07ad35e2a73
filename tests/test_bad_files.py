"""Bad files are refused early and clearly: corpora, checkpoints and a missing environment.

The companion of tests/test_bad_inputs.py (whose helpers it uses) for inputs that are files
rather than values. Corpora go through the data-processing nodes as `kedro run --pipeline
data_processing` calls them; a checkpoint given as `training.resume_from` goes through what
the training node checks before any worker starts (`make_worker_spec`), and through what
the workers check when they restore it (`read_manifest(verify=True)`, `check_compatible`),
and to `python -m meshtrain consolidate`. Each case is a `Refused` (or exit code 1) that
names the file or parameter, in at most 15 lines, with nothing written before changed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from meshtrain.checkpoint import consolidate_checkpoint
from meshtrain.checkpoint.files import MANIFEST, MARKER, SHARD_WEIGHTS, shard_dir_name
from meshtrain.checkpoint.manifest import read_manifest
from meshtrain.commands import main
from meshtrain.config import RUN_GROUPS, Refused, RunConfig
from meshtrain.launch.job import make_worker_spec
from meshtrain.pipeline_registry import register_pipelines
from meshtrain.pipelines.data_processing.nodes import build_corpus, build_tokenizer, pack_blocks
from meshtrain.pipelines.run_checks import check_parameters
from meshtrain.planner.resolve import plan_for_run
from tests.checkpoint.test_consolidate_streaming import tiny_llama, write_checkpoint
from tests.kedro_project import kedro_run, make_project
from tests.test_bad_inputs import (
    MAX_LINES,
    TRAIN_BLOCKS,
    VALIDATION_BLOCKS,
    parameters,
    snapshot,
    tokenizer,
)

__all__ = ["tiny_llama", "tokenizer"]  # fixtures, found by pytest under these names

SHARD = f"shards/{shard_dir_name(0, 0)}/{SHARD_WEIGHTS}"
PNG_HEADER = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


def assert_refused(call: Callable[[], object], *named: str) -> str:
    with pytest.raises(Refused) as refused:
        call()
    message = str(refused.value)
    for text in named:
        assert text in message, message
    printed = f"{type(refused.value).__name__}: {message}\n\n(hint)"  # as hooks prints it
    assert len(printed.splitlines()) <= MAX_LINES, message
    assert "Traceback" not in message
    return message


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A scratch project whose data/ already holds what an earlier run wrote."""
    root = make_project(tmp_path_factory.mktemp("bad_files") / "project")
    (root / "data/01_raw/corpus").mkdir()
    (root / "data/01_raw/corpus/data-00000-of-00001.arrow").write_bytes(b"an earlier corpus")
    (root / "data/02_intermediate/tokenizer").mkdir()
    (root / "data/02_intermediate/tokenizer/tokenizer.json").write_text('{"earlier": true}\n')
    return root


# --- corpora -------------------------------------------------------------------------------

TEXT = "A paragraph of plain English text, long enough to be a document.\n\n" * 20


def _corpus(folder: Path, kind: str) -> str:
    """Lay out a bad corpus of `kind` in `folder`; returns the data.text_files value."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "empty":
        (folder / "empty.txt").write_bytes(b"")
        return str(folder / "empty.txt")
    if kind == "blank":
        (folder / "blank.txt").write_text("\n\n   \n\t\n\n")
        return str(folder / "blank.txt")
    if kind == "random-bytes":
        (folder / "random.bin").write_bytes(bytes(range(128, 256)) * 64 + os.urandom(4096))
        return str(folder / "random.bin")
    if kind == "png":
        (folder / "picture.txt").write_bytes(PNG_HEADER + os.urandom(2048))
        return str(folder / "picture.txt")
    if kind == "text-then-png":  # a glob over a good file and a picture
        (folder / "a.txt").write_text(TEXT)
        (folder / "b.txt").write_bytes(PNG_HEADER + os.urandom(2048))
        return str(folder / "*.txt")
    if kind == "one-paragraph":
        (folder / "note.txt").write_text("one paragraph of text, with no blank line in it\n")
        return str(folder / "note.txt")
    if kind == "missing":
        return str(folder / "no-such-file.txt")
    if kind == "glob-matching-nothing":
        (folder / "notes.md").write_text(TEXT)
        return str(folder / "*.txt")
    raise AssertionError(kind)


CORPORA = [
    pytest.param("empty", "empty.txt", id="empty-file"),
    pytest.param("blank", "data.text_files", id="only-blank-lines"),
    pytest.param("random-bytes", "random.bin", id="random-bytes"),
    pytest.param("png", "picture.txt", id="png-named-txt"),
    pytest.param("text-then-png", "b.txt", id="glob-over-text-and-a-png"),
    pytest.param("one-paragraph", "at least 2", id="one-document"),
    pytest.param("missing", "no-such-file.txt", id="missing-file"),
    pytest.param("glob-matching-nothing", "*.txt", id="glob-matching-nothing"),
]


def run_data_processing(project: Path, params: str) -> None:
    """What `kedro run --pipeline data_processing --params <params>` does up to its writes:
    the hook's check, then each node (Kedro saves a node's output only once it returns)."""
    values = parameters(project, params)
    check_parameters(values, register_pipelines()["data_processing"])
    corpus = build_corpus(values["data"])
    tok = build_tokenizer(corpus, values["data"])
    pack_blocks(corpus, tok, values["data"])


@pytest.mark.parametrize(("kind", "named"), CORPORA)
def test_a_bad_corpus_is_refused_naming_the_file(
    kind: str, named: str, project: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.chdir(project)
    files = _corpus(tmp_path / "corpus", kind)
    before = snapshot(project / "data"), snapshot(tmp_path / "corpus")
    params = f"data.source=text_files,data.text_files={files},data.num_proc=1"
    assert_refused(lambda: run_data_processing(project, params), named, "data.text_files")
    assert (snapshot(project / "data"), snapshot(tmp_path / "corpus")) == before


def test_a_good_text_corpus_passes_the_same_path(project: Path, tmp_path: Path) -> None:
    """The control: the refusals above are about the files, not the way they are read."""
    (tmp_path / "a.txt").write_text(TEXT)
    values = parameters(project, f"data.source=text_files,data.text_files={tmp_path / 'a.txt'}")
    assert len(build_corpus(values["data"])) == 20


def test_a_hub_corpus_offline_says_so_and_how_to_provide_it(project: Path, monkeypatch) -> None:
    import datasets
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # never the network
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(project)
    before = snapshot(project / "data")
    params = "data.source=hub,data.hub_dataset=meshtrain-tests/no-such-corpus"
    message = assert_refused(
        lambda: run_data_processing(project, params),
        "data.hub_dataset=meshtrain-tests/no-such-corpus",
        "offline",
        "HF_HUB_OFFLINE",
        "data.source=text_files",
    )
    assert "load_dataset('meshtrain-tests/no-such-corpus'" in message
    assert snapshot(project / "data") == before


# --- checkpoints ---------------------------------------------------------------------------


def _run_model_config(project: Path, tokenizer, params: str = ""):
    """The model a run of `project` with `params` builds (at the tokenizer's vocabulary)."""
    from meshtrain.models import build_model_config

    model = parameters(project, params)["model"]
    return build_model_config(
        model["architecture"], dict(model["config"]), vocab_size=len(tokenizer)
    )


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory, project, tokenizer) -> Path:
    """A complete tp=1 checkpoint of the run's own model (conf/base's), with a tokenizer;
    copied per case."""
    from meshtrain.models import build_model

    root = tmp_path_factory.mktemp("good") / "run" / "checkpoint-1"
    (root / "tokenizer").mkdir(parents=True)
    (root / "tokenizer" / "tokenizer.json").write_text('{"fake": true}\n')
    model = build_model(_run_model_config(project, tokenizer), seed=0)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    return write_checkpoint(root, state, config=model.config, step=1)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _point_outside(root: Path, rel: str) -> None:
    """List `rel` in the manifest (with the shard's size and hash) and keep the marker."""
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["files"][rel] = manifest["files"][SHARD]
    (root / MANIFEST).write_text(json.dumps(manifest))


def _symlink_out(root: Path, outside: Path) -> None:
    """A listed tokenizer file that is a symlink to a file outside the folder."""
    manifest = json.loads((root / MANIFEST).read_text())
    link = root / "tokenizer" / "vocab.json"
    link.symlink_to(outside)
    manifest["files"]["tokenizer/vocab.json"] = {"bytes": outside.stat().st_size, "sha256": "0"}
    (root / MANIFEST).write_text(json.dumps(manifest))


def _spoil(root: Path, kind: str, outside: Path) -> tuple[Path, str]:
    """Spoil a copy of the good checkpoint; returns the path to pass and what it names."""
    if kind == "truncated-shard":
        data = (root / SHARD).read_bytes()
        (root / SHARD).write_bytes(data[: len(data) // 2])
        return root, SHARD
    if kind == "corrupted-shard":
        _flip_last_byte(root / SHARD)
        return root, SHARD
    if kind == "truncated-manifest":
        text = (root / MANIFEST).read_text()
        (root / MANIFEST).write_text(text[: len(text) // 2])
        return root, MANIFEST
    if kind == "manifest-without-files":
        manifest = json.loads((root / MANIFEST).read_text())
        del manifest["files"]
        (root / MANIFEST).write_text(json.dumps(manifest))
        return root, MANIFEST
    if kind == "entry-dot-dot":
        _point_outside(root, "../../../../../../etc/passwd")
        return root, "'../../../../../../etc/passwd' points outside"
    if kind == "entry-absolute":
        _point_outside(root, str(outside))
        return root, f"{str(outside)!r} points outside"
    if kind == "entry-symlink-out":
        _symlink_out(root, outside)
        return root, "'tokenizer/vocab.json' points outside"
    if kind == "no-marker":
        (root / MARKER).unlink()
        return root, MARKER
    if kind == "nonexistent":
        return root.parent / "checkpoint-999", "checkpoint-999"
    raise AssertionError(kind)


# (kind, refused before any worker starts: else only when the workers restore it)
CHECKPOINTS = [
    pytest.param("truncated-shard", True, id="truncated-shard"),
    pytest.param("corrupted-shard", False, id="corrupted-shard"),
    pytest.param("truncated-manifest", True, id="truncated-manifest"),
    pytest.param("manifest-without-files", True, id="manifest-without-files"),
    pytest.param("entry-dot-dot", True, id="manifest-entry-dot-dot"),
    pytest.param("entry-absolute", True, id="manifest-entry-absolute"),
    pytest.param("entry-symlink-out", True, id="manifest-entry-symlink-out"),
    pytest.param("no-marker", True, id="no-complete-marker"),
    pytest.param("nonexistent", True, id="nonexistent-path"),
]


@pytest.fixture
def spoilt(request, good_checkpoint: Path, tmp_path: Path):
    """(path to pass, what the refusal names, a file outside the checkpoint, snapshot)."""
    root = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(good_checkpoint, root, symlinks=True)
    outside = tmp_path / "secret.txt"
    outside.write_text("not part of any checkpoint\n")
    path, named = _spoil(root, request.param, outside)

    def unchanged() -> dict[str, str]:
        return {**snapshot(tmp_path / "run"), "outside": outside.read_text()}

    return path, named, unchanged


def _resume(project: Path, path: Path, tokenizer, extra: str = "") -> None:
    """The training node's checks before any worker starts, with resume_from=`path`."""
    params = parameters(project, f"training.resume_from={path}{extra}")
    check_parameters(params, register_pipelines()["__default__"])
    run = RunConfig.from_params(**{group: params.get(group) for group in RUN_GROUPS})
    plan = plan_for_run(
        run, tokenizer, num_train_blocks=TRAIN_BLOCKS, num_validation_blocks=VALIDATION_BLOCKS
    )
    make_worker_spec(run, plan, train_files=[], validation_files=[], tokenizer_dir=None)


@pytest.mark.parametrize(("spoilt", "before_workers"), CHECKPOINTS, indirect=["spoilt"])
def test_a_bad_checkpoint_to_resume_from_is_refused(
    spoilt, before_workers: bool, project: Path, tokenizer, monkeypatch
) -> None:
    path, named, unchanged = spoilt
    monkeypatch.chdir(project)
    before = snapshot(project / "data"), unchanged()
    if before_workers:
        assert_refused(lambda: _resume(project, path, tokenizer), "training.resume_from", named)
    else:  # sizes match: the sha256 is checked where the workers restore it
        _resume(project, path, tokenizer)
        assert_refused(lambda: read_manifest(path, verify=True), named, "sha256")
    assert (snapshot(project / "data"), unchanged()) == before


@pytest.mark.parametrize("spoilt", [p.values[0] for p in CHECKPOINTS], indirect=True)
def test_a_bad_checkpoint_is_not_consolidated(spoilt, tmp_path: Path) -> None:
    path, named, unchanged = spoilt
    output = tmp_path / "hf"
    before = unchanged()
    assert_refused(lambda: consolidate_checkpoint(path, output, progress=False), named)
    assert not output.exists() and not output.with_name("hf.partial").exists()
    assert unchanged() == before


@pytest.mark.parametrize("spoilt", ["corrupted-shard", "entry-dot-dot"], indirect=True)
def test_the_consolidate_command_exits_1_naming_the_file(
    spoilt, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path, named, unchanged = spoilt
    before = unchanged()
    assert main(["consolidate", str(path), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and len(err.splitlines()) <= MAX_LINES, err
    assert not (tmp_path / "hf").exists() and unchanged() == before


def test_a_good_checkpoint_passes_the_same_checks(
    good_checkpoint: Path, project: Path, tokenizer, tmp_path: Path, monkeypatch
) -> None:
    """The control: the refusals above are about the spoilt files."""
    root = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(good_checkpoint, root)
    monkeypatch.chdir(project)
    _resume(project, root, tokenizer)
    assert read_manifest(root, verify=True)["step"] == 1
    consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_an_unlisted_symlink_out_of_the_checkpoint_is_not_copied(
    good_checkpoint: Path, tmp_path: Path
) -> None:
    """Consolidation copies the tokenizer files the manifest lists (checked to be inside
    the folder and hashed), not whatever else lies in tokenizer/."""
    root = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(good_checkpoint, root)
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of any checkpoint\n")
    (root / "tokenizer" / "special_tokens_map.json").symlink_to(secret)
    consolidate_checkpoint(root, tmp_path / "hf", progress=False)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert not (tmp_path / "hf" / "special_tokens_map.json").exists()


def test_a_checkpoint_of_another_model_is_refused_before_any_worker(
    good_checkpoint: Path, project: Path, tokenizer, tmp_path: Path, monkeypatch
) -> None:
    """Resuming conf/base's checkpoint with a wider model names the first tensor whose
    shape differs, before the launch (the workers would only find it after building)."""
    root = tmp_path / "run" / "checkpoint-1"
    shutil.copytree(good_checkpoint, root)
    monkeypatch.chdir(project)
    before = snapshot(root)
    assert_refused(
        lambda: _resume(project, root, tokenizer, ",model.config.intermediate_size=512"),
        "tensor model.layers.0.mlp",
        "another model shape",
    )
    assert snapshot(root) == before


# --- a missing environment: a real `kedro run` ---------------------------------------------


def test_kedro_run_with_a_missing_env_names_it_and_the_ones_there(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project")
    (root / "data/01_raw/notes.txt").write_text("written before the run\n")
    before = snapshot(root / "data")
    result = kedro_run(root, "--env", "nosuchenv", timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-2000:]
    assert "Traceback" not in output and "╭" not in output, output[-4000:]
    assert "MissingEnvironmentError: --env nosuchenv" in result.stderr, output[-2000:]
    assert "base, dpo, gpu, moe, qwen3_lora, sft, team, trn1" in result.stderr
    assert len(result.stderr.strip().splitlines()) <= MAX_LINES, result.stderr
    assert snapshot(root / "data") == before
