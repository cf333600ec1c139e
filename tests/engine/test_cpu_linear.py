"""oneDNN-packed CPU linears: equal to F.linear at every batch size, and swapped in without losing tied weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tierkv.engine.cpu_linear import PackedLinear, pack_linears, packed_linear_supported

needs_onednn = pytest.mark.skipif(not packed_linear_supported(torch.float32), reason="no oneDNN in this torch build")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 16, 300])
def test_packed_linear_matches_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=g)
    x = torch.randn(rows, 80, generator=g)
    with torch.inference_mode():
        got = PackedLinear(w)(x)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert PackedLinear(w)(x[None]).shape == (1, rows, 96)


@needs_onednn
def test_pack_linears_replaces_every_linear_and_keeps_a_tied_embedding():
    model = nn.Module()
    model.embed = nn.Embedding(50, 16)
    model.proj = nn.Linear(16, 32, bias=False)
    model.head = nn.Linear(16, 50, bias=False)
    model.head.weight = model.embed.weight
    x = torch.randn(3, 16)
    want = F.linear(x, model.embed.weight)
    assert pack_linears(model) == 2
    assert isinstance(model.proj, PackedLinear) and isinstance(model.head, PackedLinear)
    assert [n for n, _ in model.named_parameters()] == ["embed.weight"]
    torch.testing.assert_close(model.head(x), want, rtol=1e-5, atol=1e-5)


def test_pack_linears_leaves_unsupported_dtypes_alone():
    model = nn.Sequential(nn.Linear(8, 8, bias=False)).half()
    assert pack_linears(model) == 0
    assert type(model[0]) is nn.Linear
