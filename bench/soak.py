"""Soak: 2,000 steps of the default model on 2 ranks (dp2, ZeRO-1), a checkpoint every
20 steps with `keep_last` 2, rank 0 logging every step into MLflow, watched from outside.

conf/base's parameters with `max_steps`, `checkpoint_every` and `keep_last` set here, on
2,400 synthetic learnable blocks (every page read before step 200). A thread of the
launcher samples each worker's /proc (VmRSS, RssAnon, RssFile, open fds) every 0.5 s and
the run folder's checkpoint-* every 0.1 s; a sample's step is the newest complete
checkpoint. Prints the figures against issue #17's targets (RSS growth after step 200
< 2%, constant fds, at most keep_last + 1 checkpoints; docs/benchmarks.md, "Soak").

    .venv/bin/python bench/soak.py [--steps 2000] [--no-mlflow] [--samples soak.csv]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import threading
import time
from collections import namedtuple
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

from bench_runs import MIB, plan_on_blocks, token_blocks  # noqa: E402  (bench/bench_runs.py)

from meshtrain.checkpoint.manifest import is_complete  # noqa: E402
from meshtrain.config import RunConfig  # noqa: E402
from meshtrain.data.blocks import arrow_files  # noqa: E402
from meshtrain.launch.elastic import run_workers  # noqa: E402
from meshtrain.launch.job import make_worker_spec  # noqa: E402
from meshtrain.launch.worker import worker_main_sequence  # noqa: E402
from meshtrain.models import build_model_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHECKPOINT_EVERY, KEEP_LAST, FROM_STEP = 20, 2, 200
TRAIN_BLOCKS, VALIDATION_BLOCKS = 2400, 64
Sample = namedtuple("Sample", "time step rank pid rss anon file fds")


def base_parameters() -> dict[str, Any]:
    """conf/base's parameter groups, merged as Kedro merges the parameters*.yml files."""
    params: dict[str, Any] = {}
    for path in sorted((REPO / "conf" / "base").glob("parameters*.yml")):
        params.update(yaml.safe_load(path.read_text()) or {})
    return params


def _status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of /proc/<pid>/status, in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def _workers(parent: int) -> list[int]:
    """The pids of `parent`'s live worker processes, oldest first: torch elastic starts
    them in local-rank order (RANK is set after exec, so /proc/<pid>/environ lacks it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] == "Z" or int(fields[1]) != parent:
                continue
            if b"spawn_main" not in (entry / "cmdline").read_bytes():
                continue  # multiprocessing's resource tracker
        except (OSError, ValueError):
            continue  # not a process, or gone
        found.append((int(fields[19]), int(entry.name)))  # field 22 of stat: start time
    return [pid for _, pid in sorted(found)]


@dataclass
class Sampler:
    run_dir: Path
    proc_every_s: float = 0.5
    dir_every_s: float = 0.1
    samples: list[Sample] = field(default_factory=list)
    most_checkpoints: int = 0
    most_checkpoints_at: list[str] = field(default_factory=list)
    step: int = 0
    ranks: dict[int, int] = field(default_factory=dict)  # pid -> rank, in order of start
    _stop: threading.Event = field(default_factory=threading.Event)

    def _look_at_checkpoints(self) -> None:
        try:
            names = sorted(
                p.name for p in self.run_dir.iterdir() if p.name.startswith("checkpoint-")
            )
        except FileNotFoundError:
            return
        if len(names) > self.most_checkpoints:
            self.most_checkpoints, self.most_checkpoints_at = len(names), names
        for name in reversed(sorted(names, key=lambda n: int(n.split("-")[1]))):
            try:
                if is_complete(self.run_dir / name):
                    self.step = max(self.step, int(name.split("-")[1]))
                    break
            except OSError:
                continue  # pruned between the listing and the look

    def _look_at_workers(self, parent: int) -> None:
        now = time.monotonic()
        for pid in _workers(parent):
            rank = self.ranks.setdefault(pid, len(self.ranks))
            try:
                status = _status(pid)
                fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
            except (OSError, KeyError):
                continue  # it exited meanwhile
            memory = (status["VmRSS"], status.get("RssAnon", 0), status.get("RssFile", 0))
            self.samples.append(Sample(now, self.step, rank, pid, *memory, fds))

    def run(self, parent: int) -> None:
        next_proc = 0.0
        while not self._stop.is_set():
            self._look_at_checkpoints()
            if time.monotonic() >= next_proc:
                self._look_at_workers(parent)
                next_proc = time.monotonic() + self.proc_every_s
            self._stop.wait(self.dir_every_s)

    def __enter__(self) -> Sampler:
        import os  # noqa: PLC0415

        self._thread = threading.Thread(target=self.run, args=(os.getpid(),), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _spec(root: Path, blocks, steps: int, tracking):
    params = base_parameters()
    training = {
        **params["training"],
        "max_steps": steps,
        "checkpoint_every": CHECKPOINT_EVERY,
        "keep_last": KEEP_LAST,
        "output_dir": str(root / "runs"),
        "run_name": "soak",
    }
    run = RunConfig.from_params(
        parallel={**params["parallel"], "data_parallel_size": 2},
        training=training,
        launch={**params["launch"], "nproc_per_node": 2},
        model=params["model"],
        data=params["data"],
        planner=params.get("planner"),
    )
    model = params["model"]
    config = build_model_config(
        model["architecture"], model["config"], vocab_size=params["data"]["vocab_size"]
    )
    plan = plan_on_blocks(run, config, blocks)
    spec = make_worker_spec(
        run,
        plan,
        train_files=arrow_files(blocks["train"]),
        validation_files=arrow_files(blocks["validation"]),
        tokenizer_dir=None,
        tracking=tracking,
    )
    return run, plan, spec


def _mlflow_run(root: Path):
    import mlflow  # noqa: PLC0415

    from meshtrain.tracking.mlflow_run import active_target  # noqa: PLC0415

    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    mlflow.set_experiment("soak")
    mlflow.start_run(run_name="soak")
    return active_target()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--no-mlflow", action="store_true", help="rank 0 logs nowhere")
    parser.add_argument("--samples", help="write every sample to this CSV file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshtrain-soak-") as tmp:
        root = Path(tmp)
        params = base_parameters()
        data = params["data"]
        blocks = token_blocks(
            root / "blocks",
            TRAIN_BLOCKS + VALIDATION_BLOCKS,
            data["vocab_size"],
            data["block_size"],
            validation=VALIDATION_BLOCKS,
        )
        tracking = None if args.no_mlflow else _mlflow_run(root)
        run, plan, spec = _spec(root, blocks, args.steps, tracking)
        print(
            f"{plan.layout.name}: {plan.num_parameters:,} parameters, {args.steps} steps, "
            f"checkpoint_every {CHECKPOINT_EVERY}, keep_last {KEEP_LAST}, "
            f"MLflow {'off' if tracking is None else 'on (sqlite)'}",
            flush=True,
        )
        started = time.monotonic()
        try:
            with Sampler(Path(spec.run_dir)) as sampler:
                (summary,) = run_workers(
                    worker_main_sequence,
                    ([spec],),
                    run.launch,
                    log_dir=root / "logs",
                    run_id="soak",
                )[0]
        finally:
            if tracking is not None:
                import mlflow  # noqa: PLC0415

                mlflow.end_run()  # before the store's folder goes
        elapsed = time.monotonic() - started
        left = sorted(p.name for p in Path(spec.run_dir).glob("checkpoint-*"))
    _report(sampler, args.steps, elapsed, summary, left)
    if args.samples:
        _write_samples(sampler, Path(args.samples))
        print(f"samples written to {args.samples}")


def _window(samples: list[Sample], first: int, last: int) -> dict[str, float] | None:
    """Medians (RSS) and the most frequent count (fds) of the samples whose step is in
    [first, last): one checkpoint interval, so a sample taken while a checkpoint is being
    written (a few more files open, buffers alive) does not stand for the whole."""
    inside = [s for s in samples if first <= s.step < last]
    if not inside:
        return None
    fds = [s.fds for s in inside]
    return {
        "step": first,
        "n": len(inside),
        "rss": statistics.median(s.rss for s in inside),
        "anon": statistics.median(s.anon for s in inside),
        "file": statistics.median(s.file for s in inside),
        "fds": max(set(fds), key=fds.count),
    }


def _report(sampler: Sampler, steps: int, elapsed: float, summary: dict, left: list) -> None:
    print(f"\n{steps} steps in {elapsed:.0f} s; final loss {summary['final_loss']:.4f}")
    print(f"{len(sampler.samples)} samples; checkpoint folders left at the end: {left}")
    # The end: the last interval before the final checkpoint is complete, the ranks still
    # training (after it they close the process group and exit, with fewer files open).
    end = steps - CHECKPOINT_EVERY
    print(
        f"\nRSS in MiB: median over the samples of steps {FROM_STEP}-{FROM_STEP + CHECKPOINT_EVERY}"
        f" and {end}-{steps}; fds: the most frequent count there"
    )
    print(
        f"{'':<6}{f'at step {FROM_STEP}':^31}  |{'at the end':^31}  |"
        f"{f'after step {FROM_STEP}':^30}"
    )
    print(
        f"{'rank':<6}{'':>4}{'VmRSS':>8}{'anon':>7}{'file':>7}{'fds':>5}  |"
        f"{'':>4}{'VmRSS':>8}{'anon':>7}{'file':>7}{'fds':>5}  |"
        f"{'growth':>8}{'max RSS':>9}{'fds min-max':>13}"
    )
    verdicts = []
    for rank in sorted({s.rank for s in sampler.samples}):
        mine = [s for s in sampler.samples if s.rank == rank]
        first = _window(mine, FROM_STEP, FROM_STEP + CHECKPOINT_EVERY)
        last = _window(mine, end, steps)
        if first is None or last is None:
            print(f"{rank:<6} no samples in one of the windows")
            continue
        after = [s for s in mine if FROM_STEP <= s.step < steps]
        growth = (last["rss"] - first["rss"]) / first["rss"] * 100
        fds = [s.fds for s in after]

        def cells(w: dict) -> str:
            return (
                f"{w['n']:>4}{w['rss'] / MIB:>8.1f}{w['anon'] / MIB:>7.1f}{w['file'] / MIB:>7.1f}"
                f"{w['fds']:>5}"
            )

        print(
            f"{rank:<6}{cells(first)}  |{cells(last)}  |{growth:>+7.2f}%"
            f"{max(s.rss for s in after) / MIB:>9.1f}{f'{min(fds)}-{max(fds)}':>13}"
        )
        verdicts.append((rank, growth, first["fds"], last["fds"]))
    print("(the first column of each window: how many samples it holds)")
    limit = KEEP_LAST + 1
    print("\ntargets (issue #17)")
    for rank, growth, fds_200, fds_end in verdicts:
        print(
            f"  rank {rank}: RSS growth after step {FROM_STEP} {growth:+.2f}% (< 2%): "
            f"{'PASS' if growth < 2 else 'FAIL'}; open fds {fds_200} -> {fds_end} (constant): "
            f"{'PASS' if fds_200 == fds_end else 'FAIL'}"
        )
    print(
        f"  most checkpoint folders at once: {sampler.most_checkpoints} "
        f"{sampler.most_checkpoints_at} (<= keep_last + 1 = {limit}): "
        f"{'PASS' if sampler.most_checkpoints <= limit else 'FAIL'}"
    )
    print(f"  (run on {datetime.date.today().isoformat()})")


def _write_samples(sampler: Sampler, path: Path) -> None:
    with path.open("w") as out:
        out.write("time_s,step,rank,pid,vmrss,rss_anon,rss_file,fds\n")
        t0 = sampler.samples[0].time if sampler.samples else 0.0
        for s in sampler.samples:
            out.write(
                f"{s.time - t0:.2f},{s.step},{s.rank},{s.pid},{s.rss},{s.anon},{s.file},{s.fds}\n"
            )


if __name__ == "__main__":
    main()
