"""The converter protocol: `parallelize` asks every converter the same questions, so a
converter the project does not have yet, one that adds a parameter, gets it initialised
through its own `weights` with no edit of `parallelize`."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshtrain.config import Layout, LoraSettings
from meshtrain.distributed.parallel_dims import ParallelDims
from meshtrain.distributed.tensor_parallel import ParameterSharding
from meshtrain.models import build_model_config
from meshtrain.models.builder import build_meta_model
from meshtrain.models.converters import ModelConverter
from meshtrain.models.cpu_linear import OneDnnLinearConverter
from meshtrain.models.llama.parallelize import parallelize
from meshtrain.models.llama.weights import RandomInit, WeightSource
from meshtrain.models.lora import LoraConverter
from tests.conftest import TINY_MODEL, TINY_VOCAB

EXTRA = "model.norm.extra"


@dataclass
class _WithExtra:
    """`base`'s weights, and 0.5 everywhere in the added parameter."""

    base: WeightSource

    def local(self, name: str, spec: ParameterSharding, tp_rank: int, tp: int) -> torch.Tensor:
        if name == EXTRA:
            return spec.local_piece(torch.full((TINY_MODEL["hidden_size"],), 0.5), tp_rank, tp)
        return self.base.local(name, spec, tp_rank, tp)


@dataclass(frozen=True)
class _ExtraParameter:
    """A converter that adds one parameter beside the final norm."""

    name: str = "extra_parameter"

    @property
    def saved_ops(self) -> frozenset:
        return frozenset()

    def convert(self, model: nn.Module) -> None:
        extra = torch.empty(model.config.hidden_size, device="meta")
        model.model.norm.register_parameter("extra", nn.Parameter(extra))

    def weights(self, base: WeightSource) -> WeightSource:
        return _WithExtra(base)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_new_converter_initialises_what_it_adds_without_an_edit_of_parallelize(one_rank):
    config = build_model_config("llama", TINY_MODEL, vocab_size=TINY_VOCAB)
    layout = Layout(1, 1, 1, 1, "1f1b", False, False, "none", False)
    dims = ParallelDims.of_layout(layout, "cpu")
    pm = parallelize(
        build_meta_model(config),
        dims,
        layout,
        torch.device("cpu"),
        nullcontext,
        weights=RandomInit(config, seed=0),
        converters=[_ExtraParameter()],
    )
    assert torch.equal(pm.parameters[EXTRA], torch.full((TINY_MODEL["hidden_size"],), 0.5))


@pytest.mark.parametrize(
    "converter",
    [OneDnnLinearConverter(), LoraConverter(LoraSettings(r=4), seed=0), _ExtraParameter()],
    ids=["onednn", "lora", "new"],
)
def test_every_converter_answers_what_parallelize_asks(converter: ModelConverter):
    for member in ("name", "saved_ops", "convert", "weights"):
        assert hasattr(converter, member), member
