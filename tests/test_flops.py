"""tierkv.flops: reference models' parameter counts and prefill FLOPs from their architecture."""

from __future__ import annotations

import pytest

from tierkv.flops import REFERENCE_MODELS, ReferenceModel, reference_model


@pytest.mark.parametrize("name,published", [
    # The parameter counts the models' cards / safetensors indexes give.
    ("llama-3.1-8b", 8_030_261_248),
    ("llama-3.1-70b", 70_553_706_496),
    ("smollm2-135m", 134_515_008),
])
def test_parameter_count_from_the_architecture_matches_the_published_one(name, published):
    assert reference_model(name).parameters == published


def test_token_block_and_prompt_flops_agree_with_the_per_token_formula():
    m = reference_model("llama-3.1-8b")
    assert m.token_flops(0) == 2 * 8_030_261_248
    assert m.token_flops(1000) == 2 * 8_030_261_248 + 4 * 32 * 32 * 128 * 1000
    by_token = sum(m.token_flops(p) for p in range(3 * 512, 4 * 512))
    assert m.block_flops(3) == pytest.approx(by_token, rel=1e-12)
    assert m.prompt_flops(5 * 512) == pytest.approx(sum(m.block_flops(d) for d in range(5)), rel=1e-12)
    assert m.prompt_flops(0) == 0.0


def test_depth_weights_are_those_of_real_models():
    # Attention adds little per 512-token block of depth on big models.
    assert REFERENCE_MODELS["llama-3.1-8b"].depth_weight() == pytest.approx(0.0166, abs=2e-4)
    assert REFERENCE_MODELS["llama-3.1-70b"].depth_weight() == pytest.approx(0.0095, abs=2e-4)


def test_bad_names_and_shapes_fail_naming_the_field():
    with pytest.raises(ValueError, match=r"^reference model: expected one of \['llama-3.1-70b'"):
        reference_model("gpt-2")
    with pytest.raises(ValueError, match=r"^m\.kv_heads: expected a divisor of heads=8, got 3"):
        ReferenceModel("m", layers=1, hidden=8, heads=8, kv_heads=3, head_dim=1, intermediate=8, vocab=8,
                       tied_embeddings=True)
    with pytest.raises(ValueError, match=r"^m\.layers: expected an integer >= 1, got 0"):
        ReferenceModel("m", layers=0, hidden=8, heads=8, kv_heads=8, head_dim=1, intermediate=8, vocab=8,
                       tied_embeddings=True)
