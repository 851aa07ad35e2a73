"""`python -m meshtrain dryrun`: a planned 8-GPU layout's rank run on fake tensors."""

from __future__ import annotations

import json
from pathlib import Path

from meshtrain.commands import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "model_configs"
GIB = 2**30
LLAMA_8B_SDP8 = [
    "--model", str(EXAMPLES / "llama-3.1-8b.json"),
    "--devices", "8", "--device", "h100", "--seq-len", "8192", "--global-batch", "8",
    "--bf16", "--dp", "8", "--tp", "1", "--pp", "1", "--sdp", "8",
]  # fmt: skip


def test_llama_8b_sharded_over_eight_h100_runs_one_rank_in_a_few_gib(capsys) -> None:
    assert main(["dryrun", *LLAMA_8B_SDP8, "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.splitlines()[-1])
    assert report["layout"].startswith("dp8-tp1-pp1-sdp8")
    (rank0,) = report["ranks"]  # one pipeline stage: its first rank
    assert (rank0["rank"], rank0["pp"], rank0["dp"], rank0["tp"]) == (0, 0, 0, 0)
    terms = rank0["terms"]
    # The model states are counted from the real shards: 8.03B parameters / 8 in fp32,
    # fp32 gradients, two AdamW moments; the planner's to the byte's rounding.
    assert 3.7 * GIB < terms["parameters"]["dry_run"] < 3.8 * GIB
    for name in ("parameters", "gradients", "optimizer_states"):
        assert abs(terms[name]["planner_over_dry_run"] - 1) < 1e-3, name
    assert terms["step_peak"]["dry_run"] > 15 * GIB  # model states and 8,192 tokens' worth
    # The planner's sharded step, corrected by this dry run (docs/dry_run.md): 0.997.
    assert abs(terms["step_peak"]["planner_over_dry_run"] - 1) < 0.05
    assert rank0["peak_at"].startswith(("forward", "backward"))
    assert report["peak_rss"] < 3 * GIB  # no tensor had storage


def test_a_rank_outside_the_world_is_refused(capsys) -> None:
    assert main(["dryrun", *LLAMA_8B_SDP8, "--rank", "8"]) == 1
    assert "--rank [8]: the world has ranks 0 to 7" in capsys.readouterr().out


def test_a_pipeline_runs_its_first_and_last_stage(capsys) -> None:
    pipelined = [*LLAMA_8B_SDP8[:-8], "--dp", "4", "--tp", "1", "--pp", "2", "--sdp", "4"]
    assert main(["dryrun", *pipelined, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["layout"].startswith("dp4-tp1-pp2-sdp4-1f1b")
    assert [(r["rank"], r["pp"]) for r in report["ranks"]] == [(0, 0), (4, 1)]
    for rank in report["ranks"]:
        assert rank["terms"]["step_peak"]["dry_run"] > 0


def test_expert_parallelism_beside_full_sharding_runs_with_the_planners_model_states(
    capsys, tmp_path: Path
) -> None:
    """A Qwen3-MoE at dp4 x ep2, fully sharded: the dry run builds the experts' FSDP2
    groups over the ranks holding them, and its model states are the planner's (dense
    / 4, experts / 2 / 2)."""
    config = {
        "model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 1024,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    flags = ["--devices", "4", "--seq-len", "256", "--global-batch", "8"]
    layout = ["--dp", "4", "--tp", "1", "--pp", "1", "--ep", "2", "--sdp", "4"]
    assert main(["dryrun", "--model", str(tmp_path), *flags, *layout, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["layout"].startswith("dp4-tp1-pp1-ep2-sdp4")
    terms = report["ranks"][0]["terms"]
    for name in ("parameters", "gradients", "optimizer_states"):
        assert abs(terms[name]["planner_over_dry_run"] - 1) < 1e-3, name
