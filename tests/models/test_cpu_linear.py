"""The Linear layers' oneDNN path: the same products as nn.Linear, the same parameters,
and nn.Linear's own forward wherever the path does not apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshtrain.models import build_model, build_model_config, cpu_linear, cpu_matmul
from meshtrain.models.cpu_linear import (
    OneDnnLinear,
    onednn_available,
    route_linears_to_onednn,
)
from meshtrain.models.cpu_matmul import cpu_matmul_choice
from tests.conftest import TINY_MODEL, TINY_VOCAB

pytestmark = pytest.mark.skipif(not onednn_available(), reason="no oneDNN in this torch")


def _pair(bias: bool) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    plain = nn.Linear(48, 40, bias=bias)
    routed = nn.Linear(48, 40, bias=bias)
    routed.load_state_dict(plain.state_dict())
    route_linears_to_onednn([routed])
    return plain, routed


@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_both_gradients_match_nn_linear(bias: bool):
    plain, routed = _pair(bias)
    x = torch.randn(3, 7, 48)
    x_plain, x_routed = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(3, 7, 40)
    out_plain, out_routed = plain(x_plain), routed(x_routed)
    out_plain.backward(grad)
    out_routed.backward(grad)
    torch.testing.assert_close(out_routed, out_plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_routed.grad, x_plain.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(routed.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(routed.bias.grad, plain.bias.grad, rtol=1e-5, atol=1e-5)


def test_frozen_input_and_frozen_weight_get_no_gradient():
    _, routed = _pair(bias=False)
    routed.weight.requires_grad_(False)
    x = torch.randn(5, 48, requires_grad=True)
    routed(x).sum().backward()
    assert x.grad is not None and routed.weight.grad is None


def test_calls_outside_the_path_run_nn_linear(monkeypatch: pytest.MonkeyPatch):
    """float64, bf16 autocast: nn.Linear's forward (the oneDNN function is not called)."""
    _, routed = _pair(bias=True)
    calls = []
    real = cpu_linear.onednn_mm_nt
    monkeypatch.setattr(cpu_linear, "onednn_mm_nt", lambda *a: calls.append(1) or real(*a))
    routed(torch.randn(2, 48))
    assert len(calls) == 1
    routed.double()(torch.randn(2, 48, dtype=torch.float64))
    routed.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert routed(torch.randn(2, 48)).dtype == torch.bfloat16
    assert len(calls) == 1


def test_a_routed_model_keeps_its_parameter_names_and_trains_the_same():
    """Only the class changes: state dict keys, and one training step's loss and gradients
    against the untouched model (different kernels, so to fp32 rounding)."""
    config = build_model_config("llama", TINY_MODEL, vocab_size=TINY_VOCAB)
    plain, routed = build_model(config, seed=3), build_model(config, seed=3)
    swapped = route_linears_to_onednn([routed])
    assert swapped == 7 * config.num_hidden_layers + 1  # q k v o gate up down, LM head
    assert list(routed.state_dict()) == list(plain.state_dict())
    assert all(isinstance(m, OneDnnLinear) for m in routed.modules() if isinstance(m, nn.Linear))
    ids = torch.randint(0, TINY_VOCAB, (2, 32))
    losses = []
    for model in (plain, routed):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, p), q in zip(plain.named_parameters(), routed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("setting", "vendor", "device", "expected"),
    [
        ("auto", "AuthenticAMD", "cpu", "onednn"),
        ("auto", "GenuineIntel", "cpu", "blas"),
        ("auto", "", "cpu", "blas"),
        ("onednn", "GenuineIntel", "cpu", "onednn"),
        ("blas", "AuthenticAMD", "cpu", "blas"),
        ("onednn", "AuthenticAMD", "cuda", None),
    ],
)
def test_the_choice_by_setting_vendor_and_device(
    monkeypatch: pytest.MonkeyPatch, setting: str, vendor: str, device: str, expected: str | None
):
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_matmul, "cpu_has_avx512", lambda: True)
    assert cpu_matmul_choice(setting, on_cpu=device == "cpu") == expected


def test_auto_keeps_mkl_on_a_cpu_without_avx512(monkeypatch: pytest.MonkeyPatch):
    """Without AVX-512 both libraries run AVX2 and MKL measured as fast or faster."""
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(cpu_matmul, "cpu_has_avx512", lambda: False)
    assert cpu_matmul_choice("auto", on_cpu=True) == "blas"
    assert cpu_matmul_choice("onednn", on_cpu=True) == "onednn"


def test_tensor_parallel_layouts_keep_dtensors_own_path(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: "AuthenticAMD")
    assert cpu_matmul_choice("onednn", on_cpu=True, tensor_parallel=True) == "blas"
    assert cpu_matmul_choice("auto", on_cpu=True, tensor_parallel=True) == "blas"


def test_the_vendor_and_flags_are_read_from_this_machine():
    assert isinstance(cpu_matmul.cpu_vendor(), str)
    assert isinstance(cpu_matmul.cpu_has_avx512(), bool)


def test_an_op_that_fails_its_check_leaves_the_run_on_torch_mm(monkeypatch: pytest.MonkeyPatch):
    """Another torch release whose private op raises or computes something else: `auto`
    and `onednn` both fall back to torch.mm rather than train on a wrong product."""

    def wrong(a: torch.Tensor, b: torch.Tensor, bias=None) -> torch.Tensor:
        return torch.zeros(a.shape[0], b.shape[0])

    monkeypatch.setattr(cpu_matmul, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(cpu_matmul, "cpu_has_avx512", lambda: True)
    try:
        monkeypatch.setattr(cpu_linear, "onednn_mm_nt", wrong)
        onednn_available.cache_clear()
        assert cpu_matmul_choice("onednn", on_cpu=True) == "blas"
        assert cpu_matmul_choice("auto", on_cpu=True) == "blas"
    finally:
        monkeypatch.undo()
        onednn_available.cache_clear()
    assert onednn_available()
