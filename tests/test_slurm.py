"""examples/slurm/train.sbatch run by a real SLURM: a one-machine cluster (Debian's SLURM
22.05, tests/slurm_cluster.py), `sbatch` as a user submits it, SIGUSR1 to the job's
step as `--signal=USR1@...` sends it before the time limit, the script's requeue, and
the requeued run's resume from `latest` to the uninterrupted run's weights.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshtrain.checkpoint import consolidate_checkpoint
from meshtrain.launch.rendezvous import free_port
from tests.kedro_project import SMALL_RUN, kedro_run, make_project, project_env
from tests.slurm_cluster import Cluster, has_state, slurm_installed, start_cluster

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "slurm" / "train.sbatch"
STEPS = 60
# Long enough that the signal lands mid-training: checkpoints every 20 steps.
TRAINING = f"training.max_steps={STEPS},training.checkpoint_every=20,training.eval_every=1000"
# What a one-machine cluster cannot give the script's #SBATCH lines: 2 nodes, 8 GPUs, 32 cores.
ON_THIS_MACHINE = ("--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2")


@pytest.fixture
def cluster():
    if os.geteuid() != 0 or not slurm_installed():
        why = "SLURM's daemons need root and slurmctld, slurmd, munge, slurm-client"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; .ci/run installs them")
        pytest.skip(why)
    # munged wants every folder above its socket open to all, which pytest's are not.
    root = Path(tempfile.mkdtemp(prefix="meshtrain-slurm-"))
    root.chmod(0o755)
    running = start_cluster(root)
    try:
        yield running
    finally:
        running.stop()
        shutil.rmtree(root, ignore_errors=True)


def _project(root: Path) -> Path:
    project = make_project(root)
    (project / ".venv").symlink_to(Path(sys.prefix))  # the script runs .venv/bin/kedro
    (project / "examples" / "slurm").mkdir(parents=True)
    shutil.copy(SCRIPT, project / "examples" / "slurm" / "train.sbatch")
    return project


def _wait_for_checkpoint(cluster: Cluster, job: int, run_dir: Path, out: Path) -> None:
    deadline = time.monotonic() + 300
    while not list(run_dir.glob("checkpoint-*/COMPLETE")):
        state = cluster.job_state(job)
        assert state["JobState"] in {"PENDING", "RUNNING"}, _report(state, out)
        assert time.monotonic() < deadline, _report(state, out)
        time.sleep(0.2)


def _report(state: dict[str, str], out: Path) -> str:
    text = out.read_text()[-4000:] if out.exists() else "(no output file)"
    return f"job {state.get('JobState')} ({state.get('Reason')}):\n{text}"


@pytest.mark.slow
@pytest.mark.long
def test_the_slurm_example_checkpoints_on_its_signal_requeues_and_resumes(
    cluster: Cluster, tmp_path: Path
):
    project = _project(tmp_path / "project")
    env = project_env(
        **cluster.env,
        NPROC_PER_NODE="2",
        MASTER_PORT=str(free_port()),
        EXTRA_PARAMS=f"{SMALL_RUN},{TRAINING}",
    )
    job = cluster.sbatch(
        project / "examples/slurm/train.sbatch", *ON_THIS_MACHINE, cwd=project, env=env
    )
    out = project / f"meshtrain-{job}.out"
    run_dir = project / "data/06_models/checkpoints" / f"meshtrain-{job}"
    _wait_for_checkpoint(cluster, job, run_dir, out)

    # What `--signal=USR1@180` does 3 minutes before the time limit, now: SIGUSR1 to
    # every process of the job's step (the launcher and its workers), not the batch shell.
    cluster.command("scancel", "--signal=USR1", str(job))
    state = cluster.wait_for(job, has_state("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 400)
    log = out.read_text()
    assert state["JobState"] == "COMPLETED", _report(state, out)
    assert state["Restarts"] == "1", _report(state, out)

    # The first run checkpointed on the signal and requeued; the second resumed from it.
    stopped = re.search(r"training stopped by SIGUSR1; .*checkpoint-(\d+) \(step \d+\)", log)
    assert stopped, log[-4000:]
    step = int(stopped.group(1))
    assert 0 < step < STEPS
    assert re.search(rf"resumed from \S*checkpoint-{step} at step {step}", log), log[-4000:]
    assert (run_dir / f"checkpoint-{STEPS}" / "COMPLETE").exists()
    assert (project / "data/06_models/consolidated/model.safetensors").exists()

    # The uninterrupted run, in the same project, to the same weights.
    straight = kedro_run(
        project,
        "--pipeline",
        "training",
        "--params",
        f"{SMALL_RUN},{TRAINING},launch.nproc_per_node=2,training.run_name=straight",
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    weights = []
    for name in (f"meshtrain-{job}", "straight"):
        final = project / "data/06_models/checkpoints" / name / f"checkpoint-{STEPS}"
        consolidate_checkpoint(final, tmp_path / name, progress=False)
        weights.append(load_file(tmp_path / name / "model.safetensors"))
    a, b = weights
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
