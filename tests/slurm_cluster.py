"""A real one-machine SLURM cluster for tests: Debian 12's SLURM 22.05 and MUNGE 0.5.15.

`start_cluster(root)` runs munged, slurmctld and slurmd in the foreground, as children of
the test process, with every file under `root` (MUNGE key, slurm.conf, state, spool, pid
files, logs) and the daemons on free ports of 127.0.0.1. It neither reads nor writes
/etc/slurm, /etc/munge or /run/munge, so a system munged or SLURM does not get in the way.
It needs root (slurmd starts the jobs) and these packages (about 10 s to install):

    apt-get install -y --no-install-recommends slurmctld slurmd munge slurm-client

Clients find the cluster through SLURM_CONF (`Cluster.env`); slurm.conf's AuthInfo names
the test munged's socket, so no client needs a MUNGE setting. Starting takes about a
second, stopping a few (up to KillWait more while jobs run).

Behaviour measured on this configuration, which tests can rely on:
- A job submitted to the idle node starts within about a second. No slurmdbd, so no
  sacct: follow a job with `Cluster.job_state` (`scontrol show job`), which keeps a
  finished job for MinJobAge (300 s).
- `scontrol requeue $SLURM_JOB_ID` from the batch script ends the run at once (its
  processes are killed, "CANCELLED ... DUE TO JOB REQUEUE"); the job goes back to
  PENDING (Reason=BeginTime) with the same id and runs again cred_expire + 1 s later,
  with SLURM_RESTART_COUNT=1. RequeueExit would do the same for an exit code.
- A requeued run truncates the output file unless `--open-mode=append` is given
  (JobFileAppend=0, SLURM's default; the backfill scheduler, not used here, appends).
- `--signal=USR1@W` (no B:) reaches every process of every job step, not the batch
  shell, at the first of slurmctld's 30 s time-limit checks at which elapsed >= limit -
  W - 30 s: so between limit - W - 30 and limit - W after the start. `scancel
  --signal=USR1 JOB` signals the same processes at once; `--batch` only the batch shell,
  `--full` both. A time limit ends the job 0-30 s after it (state TIMEOUT).
- Command-line options override #SBATCH lines: `--gpus-per-node=0` (not --gres=none)
  lifts an `#SBATCH --gpus-per-node=8`, which this cluster (no GRES) refuses with
  "Invalid generic resource (gres) specification"; `--nodes=1` and `--cpus-per-task=2`
  lift larger requests, which EnforcePartLimits=ALL refuses at submission.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("mungekey", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
# Debian installs munged, mungekey and the SLURM daemons in /usr/sbin, which a non-login
# PATH may lack.
SBIN = "/usr/sbin:/sbin"
# A requeued job waits cred_expire + 1 s before it may run again (SLURM's default is
# 120 s); 5 is the least SLURM accepts. It is also how long a step's launch credential
# stays valid between slurmctld and slurmd, hence some margin for a busy 2-core machine.
CRED_EXPIRE_S = 10
# Between the SIGTERM and the SIGKILL of a cancelled or timed-out job (default 30 s).
KILL_WAIT_S = 10
START_TIMEOUT_S = 30.0
# Job states after which a job never runs again.
FINISHED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "DEADLINE"}
)

SLURM_CONF = """\
ClusterName=meshtrain-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# No cgroups: processes are tracked by their parent ids.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
# FIFO, with the main scheduling loop every second (default 60 s): a requeued job
# starts as soon as its begin time has passed.
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
EnforcePartLimits=ALL
JobRequeue=1
ReturnToService=2
KillWait={kill_wait}
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmError(RuntimeError):
    """A SLURM command failed; `stderr` holds its message (e.g. sbatch's refusal)."""

    def __init__(self, command: list[str], returncode: int, stderr: str) -> None:
        super().__init__(f"{' '.join(command)} exited {returncode}: {stderr.strip()}")
        self.returncode = returncode
        self.stderr = stderr


def _binary(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=SBIN)


def slurm_installed() -> bool:
    """Whether the daemons and client commands are installed (starting also needs root)."""
    return all(_binary(name) for name in DAEMONS + CLIENTS)


def has_state(*states: str) -> Callable[[dict[str, str]], bool]:
    """A `Cluster.wait_for` predicate: the job is in one of `states` (e.g. "RUNNING")."""
    return lambda job: job.get("JobState") in states


def parse_job(line: str) -> dict[str, str]:
    """`scontrol show job -o` prints one line of Key=Value fields; a value may hold '='
    (TRES=cpu=1,node=1) or spaces, so fields are split only before the next 'Key='."""
    fields = re.split(r" +(?=[A-Za-z][\w:/]*=)", line.strip())
    return dict(item.split("=", 1) for item in fields if "=" in item)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _tail(path: Path, lines: int) -> str:
    if not path.exists():
        return "(no file)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Cluster:
    """A started cluster: `env` is what a client (sbatch, scontrol, srun) needs on top of
    the usual environment; `logs` are the daemons' log files, by daemon."""

    root: Path
    conf: Path
    node: str
    munge_socket: Path
    env: dict[str, str]
    logs: dict[str, Path]
    _daemons: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)

    def command(
        self,
        *args: str,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 60,
    ) -> str:
        """Run a SLURM client command against this cluster; its stdout, or `SlurmError`."""
        full_env = {**(os.environ if env is None else env), **self.env}
        command = [_binary(args[0]) or args[0], *args[1:]]
        done = subprocess.run(
            command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            raise SlurmError(command, done.returncode, done.stderr)
        return done.stdout

    def sbatch(
        self, script: Path, *options: str, cwd: Path, env: Mapping[str, str] | None = None
    ) -> int:
        """Submit `script` from `cwd` (the job's SLURM_SUBMIT_DIR and working directory) and
        return the job id. The job gets all of `env` (default: this process's environment),
        since sbatch exports it all; keep that default: with --export=NONE or a list, srun
        inside the job passes only those variables on, and its steps lose PATH."""
        out = self.command("sbatch", "--parsable", *options, str(script), cwd=cwd, env=env)
        return int(out.strip().split(";")[0])

    def job_state(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o` as a dict: JobState, Reason, Restarts, StartTime, ..."""
        return parse_job(self.command("scontrol", "show", "job", "-o", str(job_id)))

    def wait_for(
        self,
        job_id: int,
        predicate: Callable[[dict[str, str]], bool],
        timeout_s: float,
        poll_s: float = 0.5,
    ) -> dict[str, str]:
        """Poll the job until `predicate(job_state)` holds; return that state. A timeout
        raises with the last state and the daemons' log tails, which say why."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job_state(job_id)
            if predicate(job):
                return job
            if time.monotonic() > deadline:
                summary = {k: job.get(k) for k in ("JobState", "Reason", "Restarts", "RunTime")}
                raise TimeoutError(f"job {job_id} after {timeout_s} s: {summary}\n{self.tails()}")
            self._check_daemons()
            time.sleep(poll_s)

    def update(self, job_id: int, **fields: object) -> None:
        """`scontrol update JobId=N Key=Value ...`, e.g. TimeLimit=10 (minutes) on a pending
        or requeued job, or StartTime="now" to skip what is left of a requeue's wait."""
        pairs = [f"{key}={value}" for key, value in fields.items()]
        self.command("scontrol", "update", f"JobId={job_id}", *pairs)

    def tails(self, lines: int = 15) -> str:
        """The last lines of every file in the log folder (the daemons' logs and their
        stderr, where a fatal error before the log opens goes), for failure messages."""
        paths = sorted((self.root / "log").iterdir())
        return "\n".join(f"--- {path}\n{_tail(path, lines)}" for path in paths)

    def stop(self) -> None:
        """Cancel every job, end the daemons, SIGKILL whatever of the cluster is left
        (slurmstepd outlives slurmd), and wait until all of it has gone from the process
        table. Safe to call twice, and on a half-started cluster."""
        seen = self._processes()
        if self._running("slurmctld"):
            with contextlib.suppress(SlurmError, subprocess.TimeoutExpired):
                self._cancel_jobs()
        for name in reversed(list(self._daemons)):
            self._end(self._daemons.pop(name))
        left = self._processes()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # Exited slurmstepds stay zombies until init reaps them (under a second here).
        deadline = time.monotonic() + 10
        while any(Path("/proc", str(pid)).exists() for pid in seen | left):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)

    def _cancel_jobs(self) -> None:
        jobs = self.command("squeue", "-h", "-o", "%A").split()
        if jobs:
            self.command("scancel", *jobs)
        deadline = time.monotonic() + KILL_WAIT_S + 15
        while self.command("squeue", "-h", "-o", "%A").split():
            if time.monotonic() > deadline:
                return
            time.sleep(0.25)

    def _spawn(self, name: str, *args: str) -> None:
        # munged in the foreground logs to stderr only; the SLURM daemons to their log
        # files, and to stderr too.
        output = self.logs[name] if name == "munged" else self.root / "log" / f"{name}.stderr"
        with output.open("ab") as out:
            self._daemons[name] = subprocess.Popen(
                [_binary(name) or name, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,  # slurmstepd inherits it: how _processes knows its own
                env={**os.environ, **self.env},
                start_new_session=True,
            )

    def _running(self, name: str) -> bool:
        daemon = self._daemons.get(name)
        return daemon is not None and daemon.poll() is None

    def _check_daemons(self) -> None:
        for name, daemon in self._daemons.items():
            if daemon.poll() is not None:
                raise RuntimeError(f"{name} exited {daemon.returncode}\n{self.tails()}")

    @staticmethod
    def _end(daemon: subprocess.Popen) -> None:
        daemon.terminate()
        try:
            daemon.wait(timeout=15)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=15)

    def _processes(self) -> set[int]:
        """This cluster's processes: the daemons and the jobs' processes (their environment
        names this SLURM_CONF) and the slurmstepds (their environment is empty, but their
        working directory is under `root`). Other processes on the machine are not."""
        mine = {os.getpid(), os.getppid()}
        pids = (int(entry) for entry in os.listdir("/proc") if entry.isdigit())
        return {pid for pid in pids if pid not in mine and self._owns(pid)}

    def _owns(self, pid: int) -> bool:
        proc = Path("/proc", str(pid))
        try:
            if f"SLURM_CONF={self.conf}\0".encode() in (proc / "environ").read_bytes():
                return True
            stepd = (proc / "cmdline").read_bytes().startswith(b"slurmstepd")
            return stepd and Path(os.readlink(proc / "cwd")).is_relative_to(self.root)
        except OSError:  # gone, or not ours to read
            return False


def _layout(root: Path) -> Cluster:
    """Folders, a MUNGE key made for this cluster, and slurm.conf. munged wants its key's
    folder private and its socket's folder open to all (0755)."""
    root = root.resolve()
    for sub, mode in (
        ("munge", 0o700),
        ("run", 0o755),
        ("state", 0o700),
        ("spool", 0o755),
        ("log", 0o755),
    ):
        (root / sub).mkdir(parents=True, exist_ok=True)
        (root / sub).chmod(mode)
    key = root / "munge" / "munge.key"
    key.unlink(missing_ok=True)
    subprocess.run(
        [_binary("mungekey") or "mungekey", "--create", f"--keyfile={key}"],
        check=True,
        capture_output=True,
    )
    node = socket.gethostname().split(".")[0]
    ctld_port, slurmd_port = _free_ports(2)
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
    conf = root / "slurm.conf"
    munge_socket = root / "run" / "munge.sock"
    conf.write_text(
        SLURM_CONF.format(
            node=node,
            ctld_port=ctld_port,
            slurmd_port=slurmd_port,
            root=root,
            munge_socket=munge_socket,
            cred_expire=CRED_EXPIRE_S,
            kill_wait=KILL_WAIT_S,
            cpus=os.cpu_count() or 1,
            memory_mb=memory_mb,
        )
    )
    logs = {name: root / "log" / f"{name}.log" for name in DAEMONS}
    return Cluster(root, conf, node, munge_socket, {"SLURM_CONF": str(conf)}, logs)


def _wait(cluster: Cluster, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        cluster._check_daemons()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s} s\n{cluster.tails()}")
        time.sleep(0.1)


def _node_idle(cluster: Cluster) -> bool:
    try:
        return cluster.command("sinfo", "-h", "-N", "-o", "%T", timeout_s=10).strip() == "idle"
    except (SlurmError, subprocess.TimeoutExpired):  # slurmctld not listening yet
        return False


def _start_munged(cluster: Cluster, timeout_s: float) -> None:
    """munged with its own key, seed, socket and pid files: a system munged (on
    /run/munge) can run beside it."""
    private, run = cluster.root / "munge", cluster.root / "run"
    cluster._spawn(
        "munged",
        "--foreground",
        f"--key-file={private / 'munge.key'}",
        f"--seed-file={private / 'munged.seed'}",
        f"--socket={cluster.munge_socket}",
        f"--pid-file={run / 'munged.pid'}",
    )
    _wait(cluster, cluster.munge_socket.exists, "munged", timeout_s)


def start_cluster(root: Path, timeout_s: float = START_TIMEOUT_S) -> Cluster:
    """Write the key and slurm.conf under `root`, start munged, slurmctld and slurmd, and
    return once the node is idle. Call `Cluster.stop()` when done (a failed start stops
    what it started). Use a new `root` for each start (slurmctld -c forgets old jobs)."""
    if os.geteuid() != 0:
        raise PermissionError("a SLURM test cluster runs as root (slurmd starts the jobs)")
    cluster = _layout(root)
    try:
        _start_munged(cluster, timeout_s)
        cluster._spawn("slurmctld", "-D", "-c", "-f", str(cluster.conf))
        cluster._spawn("slurmd", "-D", "-c", "-N", cluster.node, "-f", str(cluster.conf))
        _wait(cluster, lambda: _node_idle(cluster), f"node {cluster.node}", timeout_s)
    except BaseException:
        cluster.stop()
        raise
    return cluster
