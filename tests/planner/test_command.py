"""`python -m meshtrain plan`: planning for hardware this machine does not have."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from meshtrain.commands import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_configs"
GIB = 2**30


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _plan_example(capsys, model: str, devices: int, device: str) -> dict:
    """A shipped example config at sequence 4096, global batch 256, bf16."""
    return _plan(
        capsys,
        "--model", str(EXAMPLES / f"{model}.json"),
        "--devices", str(devices), "--device", device,
        "--seq-len", "4096", "--global-batch", "256", "--bf16",
    )  # fmt: skip


def test_8b_on_eight_h100_fits_and_explains_the_others(capsys) -> None:
    plan = _plan_example(capsys, "llama-3.1-8b", 8, "h100")
    assert plan["device"] == "h100"
    assert 7.9e9 < plan["num_parameters"] < 8.1e9
    assert plan["global_batch_size"] == 256
    layout = plan["layout"]
    assert (
        layout["data_parallel_size"]
        * layout["tensor_parallel_size"]
        * (layout["pipeline_parallel_size"])
        == 8
    )
    assert plan["memory_estimate_per_rank"]["total"] <= 80 * GIB * 0.9
    # Plain data parallelism cannot hold 8B with AdamW in 80 GiB: it must be a refused
    # runner-up, with the reason.
    lost = {c["layout"]: c.get("lost_because", "") for c in plan["candidates"]}
    assert lost["dp8-tp1-pp1-zero1"].startswith("does not fit")
    assert all(c.get("lost_because") or c.get("rejected") for c in plan["candidates"])


def test_3b_on_a_trn1_32xlarge_weighs_pipelines_despite_tied_embeddings(capsys) -> None:
    plan = _plan_example(capsys, "llama-3.2-3b", 32, "trn1")
    assert plan["backend"] == "neuron"
    assert plan["model_config"]["tie_word_embeddings"] is True
    assert plan["memory_estimate_per_rank"]["total"] <= 16 * GIB * 0.9
    weighed = [c["layout"] for c in plan["candidates"] if "lost_because" in c]
    assert any("-pp2-" in name for name in weighed), weighed
    rejected = [c["rejected"] for c in plan["candidates"] if "rejected" in c]
    assert not any("embeddings" in r for r in rejected)


def test_3b_on_a_trn1_32xlarge_plans_the_optimum_neuron_example(capsys) -> None:
    """Llama-3.2-3B, ZeRO-1, tp 4 with SP, pp 2 over the 32 NeuronCores: dp4 x tp4 x pp2."""
    plan = _plan(
        capsys,
        "--model", str(EXAMPLES / "llama-3.2-3b.json"),
        "--devices", "32", "--device", "trn1", "--tp", "4", "--pp", "2", "--zero-1", "true",
        "--seq-len", "1024", "--global-batch", "256", "--bf16",
    )  # fmt: skip
    layout = plan["layout"]
    assert (layout["data_parallel_size"], layout["tensor_parallel_size"]) == (4, 4)
    assert layout["pipeline_parallel_size"] == 2
    assert layout["zero_1"] and layout["sequence_parallel"]
    assert plan["memory_estimate_per_rank"]["total"] <= 16 * GIB * 0.9


def test_the_human_readable_table_names_the_choice_and_the_runners_up(capsys) -> None:
    assert (
        main(
            [
                "plan",
                "--model",
                str(EXAMPLES / "llama-3.1-8b.json"),
                "--devices",
                "8",
                "--device",
                "h100",
                "--seq-len",
                "4096",
            ]
        )  # fmt: skip
        == 0
    )
    out = capsys.readouterr().out
    assert "chosen: " in out
    assert "optimizer_states" in out
    assert "other layouts:" in out and "does not fit" in out
    # The estimate as MFU against the H100's fp32 (TF32) peak: about the profile's
    # sustained 40% (a little over: MFU counts attention whole, the time model its causal
    # half).
    mfu = float(re.search(r"MFU (\d\.\d\d) at that rate, of 8 x 494.7 TFLOP/s", out).group(1))
    assert 0.35 < mfu < 0.45


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no/such/config.json", "--devices", "8"], "no such file"),
        (
            [
                "--model",
                str(EXAMPLES / "llama-3.1-8b.json"),
                "--devices",
                "8",
                "--device",
                "tpu9",
            ],
            "planner.device='tpu9' is not a known device",
        ),  # fmt: skip
    ],
)
def test_bad_input_is_refused_with_what_works(capsys, args: list[str], message: str) -> None:
    assert main(["plan", *args]) == 1
    assert message in capsys.readouterr().out
