"""Shared fixtures. Everything runs offline and writes only under pytest's tmp dirs."""

from __future__ import annotations

from meshtrain.offline import use_offline_defaults

use_offline_defaults()

import contextlib  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import datasets  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """pytest writes the running test's name into PYTEST_CURRENT_TEST, so the environment
    of this process changes with every test, and the warm-rank server (`launch.warm`),
    which restarts when its launcher's environment changed, would start again (about 5 s
    of imports) for every test that runs a group. No import reads that variable: pytest
    leaves it unset here."""
    import _pytest.runner  # noqa: PLC0415

    assert hasattr(_pytest.runner, "_update_current_test_var"), "pytest moved it"
    _pytest.runner._update_current_test_var = lambda item, when: None


TINY_MODEL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
}
TINY_VOCAB = 256
TINY_BLOCK = 32


@pytest.fixture(scope="session")
def tiny_blocks(tmp_path_factory) -> datasets.DatasetDict:
    """Learnable token blocks (arithmetic sequences mod the vocabulary), saved to disk and
    loaded back memory-mapped, like the pipeline's."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, TINY_VOCAB, (160, 1), generator=generator)
    stride = torch.randint(1, 4, (160, 1), generator=generator)
    ids = ((start + stride * torch.arange(TINY_BLOCK)) % TINY_VOCAB).to(torch.int32)
    blocks = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"input_ids": ids[:128].tolist()}),
            "validation": datasets.Dataset.from_dict({"input_ids": ids[128:].tolist()}),
        }
    )
    path = tmp_path_factory.mktemp("blocks") / "packed"
    blocks.save_to_disk(str(path))
    return datasets.load_from_disk(str(path))


def child_processes(parent: int) -> list[tuple[int, str]]:
    """(pid, command line) of the live child processes of `parent`, read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        # The command may hold spaces and parentheses: state and ppid follow the last ')'.
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state != "Z" and int(ppid) == parent:
            found.append((int(entry.name), cmdline))
    return found


@pytest.fixture(scope="session")
def team(tmp_path_factory):
    """The team stack of tests/servers.py (PostgreSQL, an MLflow server with basic auth,
    the team runs), started on first use and shared by tests/test_team_env.py and
    tests/test_mlflow_ui.py; stopped at the end of the session, passed or failed."""
    from tests import servers

    try:
        yield servers.team_tracking(tmp_path_factory)
    finally:
        servers.stop_team_tracking()


@pytest.fixture(scope="session")
def packed_blocks(tmp_path_factory) -> datasets.DatasetDict:
    """Fine-tuning blocks: whole examples packed side by side, completion-only loss masks
    (tests/distributed/packed.py)."""
    from tests.distributed.packed import build_packed_blocks

    return build_packed_blocks(tmp_path_factory.mktemp("sft") / "packed")


def worker_processes(launcher: int) -> list[int]:
    """The ranks `launcher` runs: its spawned children, or the children of its warm-rank
    server (`launch.warm`, a forkserver: the ranks' parent; a new interpreter, or a fork
    of the launcher with its command line). multiprocessing's resource tracker and the
    server itself are no workers."""
    own = Path(f"/proc/{launcher}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    workers = []
    for pid, cmdline in child_processes(launcher):
        if "multiprocessing.forkserver" in cmdline or cmdline == own:
            workers += [child for child, _ in child_processes(pid)]
        elif "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            workers.append(pid)
    return workers


def is_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# The modules that share a session stack (tests/servers.py's team tracking, the sweep of
# tests/test_sweep.py): one worker builds it for all of them.
SHARED_STACKS = {
    "tests/test_mlflow_ui.py": "team",
    "tests/test_team_env.py": "team",
    "tests/test_notebook.py": "sweep",
    "tests/test_sweep.py": "sweep",
}


def _unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return SHARED_STACKS.get(module, module)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where it is not loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `-n 2` (pytest-xdist) a worker's unit of work is a module, or the modules that
    share a stack, so a module's fixtures are built once (xdist's own `loadgroup` does not
    group under pytest 9.2: its group suffix never reaches `item.nodeid`). The units start
    in the order collection left them (below)."""
    from xdist.scheduler import LoadScopeScheduling  # noqa: PLC0415

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On pytest-xdist's workers, the units with the longest tests (`long`, then `slow`)
    first, each unit in its own order: the last units to start are short, so the workers
    end together. In one process the order stays the files'."""
    if not hasattr(config, "workerinput"):
        return
    rank: dict[str, list[int]] = {}  # unit -> [-long tests, -slow tests, first index]
    for index, item in enumerate(items):
        key = rank.setdefault(_unit(item.nodeid), [0, 0, index])
        key[0] -= item.get_closest_marker("long") is not None
        key[1] -= item.get_closest_marker("slow") is not None
    items.sort(key=lambda item: rank[_unit(item.nodeid)])


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, size: str):
    """A tmpfs of `size` (mount's spelling: "4m") at `folder`: a filesystem that fills up.
    Skips the test where none can be mounted (not root)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
