"""`evaluation.*`: refusals naming the parameter, where and in what precision the model is
scored, the prompts taken from the validation text, and the lm-evaluation-harness glue
(meshtrain's offline task is found without the harness's own index)."""

from __future__ import annotations

import pytest
import torch

from meshtrain import benchmarks
from meshtrain.config import ConfigError, EvaluationConfig, check_evaluation, parse
from meshtrain.evaluation import resolve_device, resolve_dtype, validation_prompts


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ({"device": "gpu"}, "evaluation.device"),
        ({"dtype": "fp8"}, "evaluation.dtype"),
        ({"num_samples": 0}, "evaluation.num_samples"),
        ({"temperature": 0}, "evaluation.temperature"),
        ({"top_p": 1.5}, "evaluation.top_p"),
        ({"repetition_penalty": -1}, "evaluation.repetition_penalty"),
        ({"lm_eval_limit": 0}, "evaluation.lm_eval_limit"),
        ({"lm_eval_tasks": 3}, "evaluation.lm_eval_tasks"),
        ({"prompt": "The"}, "evaluation.prompt"),
    ],
)
def test_bad_evaluation_values_are_refused_by_name(values, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")) as error:
        check_evaluation(parse(EvaluationConfig, values, "evaluation"))
    assert len(str(error.value).splitlines()) <= 3


def test_evaluation_runs_where_and_how_the_model_trained():
    assert resolve_device("auto", "gloo") == "cpu"
    cuda = torch.cuda.is_available()
    assert resolve_device("auto", "nccl") == ("cuda" if cuda else "cpu")
    assert resolve_dtype("auto", "bf16_master", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "bf16_master", "cpu") == torch.float32
    assert resolve_dtype("auto", "no", "cuda") == torch.float32
    assert resolve_dtype("float16", "no", "cpu") == torch.float16
    if not cuda:
        with pytest.raises(ConfigError, match="evaluation.device"):
            resolve_device("cuda:1", "nccl")


class _Words:
    """A stand-in tokenizer: one token per character."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_prompts_are_whole_words_of_blocks_spread_over_the_validation_split():
    import datasets

    texts = ["xx alpha beta gamma delta", "yy one two three four five", "zz red green blue"]
    blocks = datasets.Dataset.from_dict({"input_ids": [[ord(c) for c in t] for t in texts]})
    prompts = validation_prompts(blocks, _Words(), count=2, prompt_tokens=14)
    assert prompts == ["alpha beta", "red green"]


def test_lm_eval_scores_are_flattened_by_task_and_metric():
    results = {
        "results": {
            "arc_easy": {"alias": "arc_easy", "acc,none": 0.5, "acc_stderr,none": "N/A"},
            "gsm8k": {"exact_match,strict-match": 0.25},
        }
    }
    assert benchmarks.scores(results) == {
        "arc_easy/acc": 0.5,
        "gsm8k/exact_match_strict-match": 0.25,
    }


def test_the_offline_task_is_known_and_a_typo_is_refused_with_the_closest_name():
    manager = benchmarks.task_manager(defaults=False)
    benchmarks.check_tasks(["meshtrain_python_basics"], manager)
    with pytest.raises(ConfigError, match="did you mean 'meshtrain_python_basics'"):
        benchmarks.check_tasks(["meshtrain_python_basic"], manager)
    with pytest.raises(ConfigError, match="evaluation.lm_eval_include_path"):
        benchmarks.task_manager("/nonexistent/tasks")
    # Its items ship in the package and load with no network.
    from meshtrain.lm_eval_tasks.utils import load_docs

    test = load_docs()["test"]
    assert len(test) == 32 and all(0 <= row["answer"] < len(row["choices"]) for row in test)
