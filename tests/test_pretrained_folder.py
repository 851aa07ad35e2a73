"""With `model.init_from` the pretrained folder defines the model: its architecture and
its tokenizer come with it, and a tokenizer that is not the model's is refused before the
data pipeline does any work, in one sentence, with data/ untouched."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from meshtrain.config import Refused
from meshtrain.data.pretrained_tokenizer import tokenizer_to_load
from meshtrain.data.tokenizer import load_tokenizer, train_tokenizer
from meshtrain.models.builder import build_model_config
from meshtrain.pipeline_registry import register_pipelines
from tests.kedro_project import make_project
from tests.test_bad_inputs import MAX_LINES, parameters, snapshot, validate_and_plan

TEXT = "the quick brown fox {} jumps over the lazy dog; {} dogs sleep"


def _tokenizer(words: str, size: int = 320):
    corpus = datasets.Dataset.from_dict({"text": [TEXT.format(i, words) for i in range(300)]})
    return train_tokenizer(corpus, size)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project with a small pretrained Qwen2 folder (its own tokenizer), the same folder
    without a tokenizer, another tokenizer of the same size, and an earlier run's data."""
    root = make_project(tmp_path_factory.mktemp("pretrained") / "project")
    own = _tokenizer("several")
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(own),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = AutoModelForCausalLM.from_config(config)
    for name in ("pretrained", "bare"):
        model.save_pretrained(root / name)
    own.save_pretrained(root / "pretrained")
    other = _tokenizer("completely different words about cats")
    assert len(other) == len(own) and other.get_vocab() != own.get_vocab()
    other.save_pretrained(root / "other_tokenizer")
    (root / "data/01_raw/corpus.txt").write_text("an earlier run's corpus\n")
    return root


@pytest.fixture(scope="module")
def default_pipeline():
    return register_pipelines()["__default__"]


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ("model.init_from=pretrained,data.tokenizer=other_tokenizer", "data.tokenizer"),
        ("model.init_from=bare", "has no tokenizer"),
        ("model.init_from=pretrained,model.architecture=llama", "model.architecture"),
    ],
    ids=["another-vocabulary-of-the-same-size", "folder-without-tokenizer", "architecture"],
)
def test_a_tokenizer_or_architecture_not_the_folders_is_refused(
    params: str, named: str, project: Path, default_pipeline, monkeypatch
) -> None:
    monkeypatch.chdir(project)
    before = snapshot(project / "data")
    tokenizer = load_tokenizer("pretrained")
    with pytest.raises(Refused) as refused:
        validate_and_plan(parameters(project, params), default_pipeline, tokenizer)
    message = str(refused.value)
    assert named in message, message
    assert len(f"{type(refused.value).__name__}: {message}\n\n(hint)".splitlines()) <= MAX_LINES
    assert snapshot(project / "data") == before


def test_the_folder_alone_brings_architecture_and_tokenizer(
    project: Path, default_pipeline, monkeypatch
) -> None:
    monkeypatch.chdir(project)
    params = parameters(project, "model.init_from=pretrained")
    assert params["model"]["architecture"] == "auto" and params["data"]["tokenizer"] is None
    folder = tokenizer_to_load(None, "pretrained")
    assert folder == "pretrained"
    tokenizer = load_tokenizer(folder)
    validate_and_plan(params, default_pipeline, tokenizer)
    config = build_model_config("auto", {}, vocab_size=None, init_from="pretrained")
    assert config.model_type == "qwen2"
