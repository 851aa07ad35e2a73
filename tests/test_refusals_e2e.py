"""Every class of mistake, as a user meets it: a real `kedro run` in a scratch project
whose data/ holds an earlier run's corpus (with a `datasets` cache file in it) and
tokenizer. Each run must exit non-zero with meshtrain's message alone (no traceback, at
most 15 lines of it), naming the parameter, before the first node completes (or, where
the check needs the data, before training starts), and leave every file under data/
byte-identical. The runs are independent, so they start together and share the cores.
Every parameter group is refused the same way, by the same hook, in the matrix of
tests/test_bad_inputs.py, without a process each.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import datasets
import pytest

from meshtrain.data.tokenizer import train_tokenizer
from meshtrain.planner.host import GIB, Host
from tests import warm_kedro
from tests.kedro_project import make_project, project_env
from tests.test_bad_inputs import MAX_LINES, snapshot

REFUSED = "(meshtrain refused the run"
# Checks that need the data: the data nodes run first, training never.
AFTER_DATA = ("block_size", "nul_bytes")


def _earlier_run(root: Path) -> None:
    """What a successful run left in data/: the corpus (with a cache file `datasets`
    wrote beside it) and the tokenizer."""
    corpus = datasets.Dataset.from_dict({"text": [f"an earlier document {i}" for i in range(50)]})
    corpus.save_to_disk(str(root / "data/01_raw/corpus"))
    (root / "data/01_raw/corpus/cache-0123456789abcdef.arrow").write_bytes(b"cached map")
    train_tokenizer(corpus, 300).save_pretrained(str(root / "data/02_intermediate/tokenizer"))


def _cases(tmp_path: Path) -> dict[str, tuple[str, list[str]]]:
    """Case -> (--params, what the message must say)."""
    nul = tmp_path / "zeros.txt"
    nul.write_bytes(b"\0" * 5000)
    short = tmp_path / "short.txt"
    short.write_text("\n\n".join(f"Paragraph {i} is short." for i in range(8)))
    # More ranks than this host holds at over 0.5 GiB each (a rank's process estimate is
    # the cpu profile's 0.5 GiB runtime and its tensors): 64 on the 24 GiB machines.
    ranks = max(64, math.ceil(Host.here().memory_bytes / (GIB / 2)) + 1)
    return {
        # 1. parameters read after training
        "consolidation": ("consolidation.dtype=int8", ["`consolidation.dtype` is 'int8'"]),
        "evaluation": (
            "evaluation.lm_eval_tasks=hellaswg",
            ["`evaluation.lm_eval_tasks` names 'hellaswg'", "did you mean 'hellaswag'"],
        ),
        # 2. what a library would have said, in a traceback
        "tokenizer": ("data.tokenizer=/nonexistent/tok", ["`data.tokenizer` '/nonexistent/tok'"]),
        "init_from": ("model.init_from=conf", ["`model.init_from` 'conf' has no config.json"]),
        "block_size": (  # within the model's positions, longer than the corpus
            f"data.block_size=512,data.source=text_files,data.text_files={short},"
            "data.vocab_size=300,data.num_proc=1",
            ["`data.block_size=512` is longer than the train split"],
        ),
        "nul_bytes": (
            f"data.source=text_files,data.text_files={nul}",
            [f"data.text_files: {nul} is not UTF-8 text (byte 0 "],
        ),
        # 3. a model field transformers refuses
        "model": (
            "model.config.hidden_size=130",
            ["`model.config.hidden_size=130`", "`model.config.num_attention_heads=4`", "132"],
        ),
        # 4. the host
        "launch": (
            f"launch.nproc_per_node={ranks}",
            [f"launch.nproc_per_node={ranks}: {ranks} ranks x", "GiB per rank"],
        ),
        # the README's example of a refusal before any work, and a value out of range
        "training": ("training.keep_last=-1", ["`training.keep_last` is -1"]),
    }


@pytest.mark.slow
@pytest.mark.long
def test_each_class_of_mistake_is_refused_before_any_work(tmp_path: Path) -> None:
    cases = _cases(tmp_path)
    runs = {}
    for name, (params, _) in cases.items():
        root = make_project(tmp_path / name)
        _earlier_run(root)
        before = snapshot(root / "data")
        process = warm_kedro.start(
            ["run", "--params", params],
            root,
            project_env(),
            tmp_path / f"{name}.out",
            tmp_path / f"{name}.err",
        )
        runs[name] = (root, before, process)
    for name, (root, before, process) in runs.items():
        out, err = process.communicate(timeout=600)
        output = out + err
        assert process.returncode != 0, (name, output[-3000:])
        assert "Traceback" not in output, (name, output[-4000:])
        message = _refusal(err)
        for text in cases[name][1]:
            assert text in message, (name, message)
        assert len(message.strip().splitlines()) <= MAX_LINES, (name, message)
        assert snapshot(root / "data") == before, name
        assert not list((root / "data").rglob("*.staged")), name
        if name in AFTER_DATA:  # data nodes ran; training did not
            assert "Running node: build_corpus" in output, (name, output[-3000:])
            assert "Running node: train_model" not in output, (name, output[-3000:])
        else:
            assert "Running node" not in output, (name, output[-3000:])


def _refusal(stderr: str) -> str:
    """The refusal as the project's exception hook printed it, to its last line."""
    end = stderr.index(REFUSED)
    starts = list(re.finditer(r"^[A-Z]\w*: ", stderr[:end], re.M))
    assert starts, stderr[-3000:]
    return stderr[starts[-1].start() : stderr.index("\n", end)]
