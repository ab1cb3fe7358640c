"""GGUF blocks in affine form: exactly the values gguf.dequantize gives, for every type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from tiny_gguf import k_quant_bytes

from pagedlm.model_executor.loader.gguf_blocks import AFFINE_TYPES, decode_blocks

# Code bits per type: 4-bit types never exceed 15, 5-bit ones 31, Q8_0 uses the full byte.
CODE_LIMITS = {
    **{"Q4_0": 15, "Q4_1": 15, "Q4_K": 15, "Q5_0": 31, "Q5_1": 31, "Q5_K": 31},
    **{"Q2_K": 3, "Q3_K": 7, "Q6_K": 63},
}
GROUPS = {"Q2_K": 16, "Q3_K": 16, "Q6_K": 16}


def _raw(values: np.ndarray, type_name: str) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name.endswith("_K"):
        return k_quant_bytes(values, qtype)
    return gguf.quants.quantize(values, qtype)


@pytest.mark.parametrize("type_name", AFFINE_TYPES)
def test_affine_form_reproduces_gguf_dequantize(type_name):
    rng = np.random.default_rng(1)
    # Wide-ranging rows, with an offset so Q*_1 minimums are not all negative.
    values = (rng.standard_normal((6, 512)) * rng.uniform(0.01, 3, (6, 1)) + 0.3).astype(np.float32)
    raw = _raw(values, type_name)
    qtype = gguf.GGMLQuantizationType[type_name]
    expected = gguf.dequantize(raw, qtype).reshape(values.shape)
    blocks = decode_blocks(raw.reshape(-1), type_name, values.shape, groups_of_16=True)
    assert blocks is not None
    group = GROUPS.get(type_name, 32)
    assert blocks.codes.dtype == torch.uint8 and blocks.codes.shape == (6, 512)
    assert blocks.scales.shape == blocks.mins.shape == (6, 512 // group)
    assert blocks.group_size == group
    assert int(blocks.codes.max()) <= CODE_LIMITS.get(type_name, 255)
    np.testing.assert_array_equal(blocks.dequantize().numpy(), expected)


@pytest.mark.parametrize("type_name", ["F32", "F16", "Q6_K", "Q3_K", "Q2_K"])
def test_types_without_groups_of_32_have_no_affine_form(type_name):
    # Q2_K, Q3_K and Q6_K scale groups of 16 weights; float types have no blocks at all.
    assert decode_blocks(np.zeros(0, np.uint8), type_name, (0, 256)) is None


@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ2_XS", "TQ1_0"])
def test_types_that_are_not_affine_are_not_decoded(type_name):
    assert decode_blocks(np.zeros(0, np.uint8), type_name, (0, 256), groups_of_16=True) is None


def test_q6_k_codes_use_all_six_bits():
    raw = _raw(np.zeros((4, 1024), np.float32), "Q6_K")
    blocks = decode_blocks(raw.reshape(-1), "Q6_K", (4, 1024), groups_of_16=True)
    assert int(blocks.codes.max()) == 63 and int(blocks.codes.min()) == 0
    assert (blocks.scales < 0).any() and (blocks.scales > 0).any()  # signed sub-scales
