"""The skinny matmul of decode steps (kernels/cpu_linear.py) against torch's, in every vector
width, and the Linear layer's choice between it and oneDNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixflow.engine.models.layers.linear import Linear
from prefixflow.kernels import cpu_linear

pytestmark = pytest.mark.skipif(
    cpu_linear.blocked_weight(torch.zeros(1, 1)) is None, reason="no C compiler to build the CPU kernel"
)


@pytest.mark.parametrize("vector_floats", [4, 8, 16], indirect=True)
@pytest.mark.parametrize("threads", [1, 2])
def test_every_width_matches_torch(vector_floats, threads):
    gen = torch.Generator().manual_seed(vector_floats + threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # outputs not a multiple of any width, rows past one chunk of 8, a strided input
        for out, inp in [(37, 24), (64, 576), (5, 3)]:
            weight, bias = torch.randn(out, inp, generator=gen), torch.randn(out, generator=gen)
            blocked = cpu_linear.blocked_weight(weight)
            assert blocked is not None and blocked.shape == (-(-out // vector_floats), inp, vector_floats)
            for rows in (0, 1, 3, 8, 9, 16):
                wide = torch.randn(rows, inp + 5, generator=gen)
                for x in (wide[:, :inp].contiguous(), wide[:, 2 : inp + 2]):
                    assert cpu_linear.supports(x, blocked)
                    got = cpu_linear.skinny_linear(x, blocked, out, bias)
                    exact = F.linear(x.double(), weight.double(), bias.double())  # sums of ~inp terms of size 1
                    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6 * inp)
    finally:
        torch.set_num_threads(before)


def test_what_the_kernel_does_not_take():
    weight = torch.randn(8, 16)
    blocked = cpu_linear.blocked_weight(weight)
    assert cpu_linear.blocked_weight(weight.double()) is None
    assert not cpu_linear.supports(torch.randn(cpu_linear.MAX_ROWS + 1, 16), blocked)
    assert not cpu_linear.supports(torch.randn(2, 16).double(), blocked)
    assert not cpu_linear.supports(torch.randn(16, 2).t(), blocked)  # last dim strided
    assert not cpu_linear.supports(torch.randn(2, 16), None)


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("PREFIXFLOW_CPU_KERNELS", "0")
    assert cpu_linear.blocked_weight(torch.randn(8, 16)) is None


def test_a_prepacked_layer_takes_the_kernel_for_few_rows_and_onednn_for_many():
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=True)
    dense = (layer.weight.detach().clone(), layer.bias.detach().clone())
    if not layer.prepack_for_cpu():
        pytest.skip("this torch has no oneDNN prepacked linear")
    assert layer.blocked is not None and layer.weight.numel() == 0  # the dense copy is freed
    for rows in (1, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1, 300):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(layer(x), F.linear(x, *dense), rtol=1e-5, atol=1e-5)


def test_the_kernel_reads_the_width_its_weight_was_blocked_in(monkeypatch):
    # A weight blocked before the width changes (PREFIXFLOW_CPU_VECTOR_FLOATS set later) is
    # still read in its own layout: the kernel is chosen by the weight, not by the setting now.
    weight, x = torch.randn(37, 24), torch.randn(5, 24)
    for first, then in [("4", "16"), ("16", "4")]:
        monkeypatch.setenv("PREFIXFLOW_CPU_VECTOR_FLOATS", first)
        blocked = cpu_linear.blocked_weight(weight)
        monkeypatch.setenv("PREFIXFLOW_CPU_VECTOR_FLOATS", then)
        assert blocked is not None and blocked.shape[2] == int(first)
        torch.testing.assert_close(cpu_linear.skinny_linear(x, blocked, 37), F.linear(x, weight), rtol=1e-5, atol=1e-5)
