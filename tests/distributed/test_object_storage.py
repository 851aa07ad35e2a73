"""Checkpoints and models on object storage, against a real S3 endpoint (moto's server over
HTTP, s3fs the client; `tests/s3server.py`): a run writing to s3:// killed with SIGKILL in
the middle of an asynchronous save leaves the previous checkpoint `latest`, resumes from
it bitwise equal to an uninterrupted run, and consolidates from the bucket to the bucket
into a model that transformers loads; a bucket that refuses a write stops the run in one
line naming the object, the previous checkpoint still complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshtrain.checkpoint import consolidate_checkpoint, remote
from meshtrain.checkpoint.manifest import CheckpointError
from meshtrain.models.llama import pretrained
from tests.conftest import TINY_MODEL, TINY_VOCAB
from tests.distributed.reference import run_group
from tests.distributed.stop_run import spec_for, stop_run_config
from tests.s3server import BUCKET, s3_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RUNS = f"s3://{BUCKET}/runs"


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3")) as control:
        yield control


@pytest.fixture(scope="module")
def saved_blocks(tiny_blocks, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("blocks") / "blocks"
    tiny_blocks.save_to_disk(str(folder))
    return folder


def _start_run(blocks: Path, out: str, max_steps: int, cwd: Path) -> subprocess.Popen:
    """A 2-rank run checkpointing every 2 steps to `out`, in its own process group, its
    local run folder under `cwd`."""
    command = ["-m", "tests.distributed.stop_run", str(blocks), out, str(max_steps), "3e-3", "2"]
    return subprocess.Popen(
        [sys.executable, *command],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )


def _steps(run_url: str) -> list[int]:
    return [step for step, _ in remote.checkpoints(run_url)[0]]


def test_a_run_on_s3_killed_mid_save_resumes_bitwise_and_consolidates_to_s3(
    bucket: Path, saved_blocks: Path, tiny_blocks, tmp_path: Path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the runs' local folders (logs, staging, downloads)
    # The bucket stalls the upload of checkpoint-4: the save is in flight, training goes on.
    bucket.write_text(json.dumps({"stall": "runs/stopped/checkpoint-4/"}))
    stalled = bucket.with_suffix(".stalled")
    process = _start_run(saved_blocks, RUNS, 8, tmp_path)
    deadline = time.monotonic() + 300
    while not stalled.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # every process of the job, writers included
    output = process.communicate()[0]
    assert stalled.exists(), output[-3000:]
    bucket.write_text("{}")
    assert _steps(f"{RUNS}/stopped") == [2]  # the interrupted save never looks complete

    straight = stop_run_config(tmp_path / "local", 8, run_name="straight", checkpoint_every=2)
    resumed = stop_run_config(RUNS, 8, resume_from="latest", checkpoint_every=2)
    specs = [spec_for(run, tiny_blocks) for run in (straight, resumed)]
    assert specs[1].resume_from.endswith("resume/checkpoint-2")  # downloaded once, here
    first, second = run_group(specs, 2, tmp_path, "t-s3")
    assert second["losses"] == first["losses"][2:]
    assert second["final_checkpoint"] == f"{RUNS}/stopped/checkpoint-8"
    assert _steps(f"{RUNS}/stopped") == [2, 4, 6, 8]  # the half-written 4 was replaced

    # From the bucket to the bucket with the command; transformers loads the download.
    model_url = f"s3://{BUCKET}/models/resumed"
    subprocess.run(
        [sys.executable, "-m", "meshtrain", "consolidate", f"{RUNS}/stopped", model_url],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    kept = tmp_path / "data" / "06_models" / "remote" / "s3" / BUCKET / "models"
    assert not kept.exists()  # the command keeps no local copy of the model
    downloaded = remote.download_folder(model_url, tmp_path / "downloaded")
    consolidate_checkpoint(first["final_checkpoint"], tmp_path / "straight", progress=False)
    a = load_file(tmp_path / "straight" / "model.safetensors")
    b = load_file(downloaded / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(downloaded)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], a[k]) for k in a if k in loaded)


def test_a_model_to_start_from_is_copied_once_and_kept_up_to_date(bucket, tmp_path, monkeypatch):
    """`model.init_from` on object storage: a local copy, refreshed object by object."""
    monkeypatch.setattr(pretrained, "REMOTE_CACHE", tmp_path / "cache")
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path / "model"
    config = LlamaConfig(vocab_size=TINY_VOCAB, **TINY_MODEL)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    url = f"s3://{BUCKET}/models/start"
    remote.upload_folder(folder, url)
    local = Path(pretrained.resolve_init_from(url))
    weights = local / "model.safetensors"
    assert weights.read_bytes() == (folder / "model.safetensors").read_bytes()
    before = weights.stat().st_mtime_ns
    config = json.loads((folder / "config.json").read_text())
    remote.write_text(f"{url}/config.json", json.dumps({**config, "rms_norm_eps": 1e-5}))
    again = Path(pretrained.resolve_init_from(url))
    assert again == local and weights.stat().st_mtime_ns == before  # not fetched again
    assert json.loads((local / "config.json").read_text())["rms_norm_eps"] == 1e-5


def test_a_bucket_that_refuses_a_write_stops_the_run_in_one_line(
    bucket: Path, saved_blocks: Path, tmp_path: Path
):
    runs = f"s3://{BUCKET}/refusing"
    bucket.write_text(json.dumps({"refuse": "refusing/stopped/checkpoint-4/"}))
    try:
        process = _start_run(saved_blocks, runs, 6, tmp_path)
        output = process.communicate(timeout=300)[0]
    finally:
        bucket.write_text("{}")
    assert process.returncode == 4, output[-3000:]
    line = next(line for line in output.splitlines() if line.startswith("REFUSED: "))
    assert f"cannot write {runs}/stopped/checkpoint-4/" in line and "Access Denied" in line
    assert _steps(f"{runs}/stopped") == [2]


def test_what_is_not_on_the_bucket_is_refused_naming_it(bucket, tmp_path: Path):
    empty = f"s3://{BUCKET}/nothing-here"
    with pytest.raises(CheckpointError, match=r"latest: no complete checkpoint under .*/\*"):
        remote.find_resume(empty, "latest", None)
    half = f"s3://{BUCKET}/half/run/checkpoint-9"
    remote.write_text(f"{half}/config.json", "{}")  # written, never marked complete
    with pytest.raises(CheckpointError, match="checkpoint-9 has no COMPLETE marker"):
        remote.find_checkpoint(half, "training.resume_from")
    with pytest.raises(CheckpointError, match="consolidation.checkpoint: no complete"):
        remote.find_checkpoint(f"s3://{BUCKET}/half/run", "consolidation.checkpoint")
    with pytest.raises(CheckpointError, match="needs gcsfs"):  # not installed here
        remote.filesystem("gs://a-bucket/runs")
    # A key that climbs out of the folder being copied (S3 allows `..` in keys).
    import boto3

    boto3.client("s3").put_object(Bucket=BUCKET, Key="climb/run/../../escaped", Body=b"x")
    with pytest.raises(CheckpointError, match="holds an object outside it"):
        remote.download_folder(f"s3://{BUCKET}/climb/run", tmp_path / "copy" / "run")
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "copy" / "escaped").exists()
    # An endpoint that does not answer: the client's own error, in one line with the URL.
    unreachable = {**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1"}
    command = ["-m", "meshtrain", "consolidate", f"s3://{BUCKET}/runs/r", str(tmp_path / "out")]
    result = subprocess.run(
        [sys.executable, *command], env=unreachable, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: cannot list s3://{BUCKET}/runs/r: Could not connect")
    assert remote.is_url("s3://b/k") and not remote.is_url("file:///tmp/x")
    assert not remote.is_url("data/06_models") and not remote.is_url(Path("s3://b"))
