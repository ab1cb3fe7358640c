"""GGUF weights kept quantized on the GPU: the device layout, the GEMV, the tiled GEMM and
the dequantizing kernel, against the loader's affine form (``AffineBlocks.dequantize``,
itself exactly ``gguf.dequantize``). Under ``TRITON_INTERPRET=1`` on CPU without a GPU."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton_env import DEVICE, rel_error

from loader.tiny_gguf import k_quant_bytes
from pagedlm.model_executor.loader.gguf_blocks import AffineBlocks, decode_blocks
from pagedlm_cuda.kernels.gguf_gemm import dequantize_into, gguf_gemm
from pagedlm_cuda.kernels.gguf_gemv import (
    default_gemv_config,
    gguf_gemv,
    pack_blocks,
    pack_words,
)
from pagedlm_cuda.kernels.gguf_gemv_half import gguf_gemv_half, takes_half_products
from pagedlm_cuda.kernels.gguf_gemv_int8 import dp4a, gguf_gemv_int8
from pagedlm_cuda.quantized_linear import DenseScratch, GgufCudaLinear

# type -> (code bits stored, implicit minimum offset or 0, scale dtype, columns per scale)
LAYOUTS = {
    "Q4_0": (4, 8, torch.float16, 32),
    "Q4_1": (4, 0, torch.float16, 32),
    "Q5_0": (8, 16, torch.float16, 32),
    "Q8_0": (8, 128, torch.float16, 32),
    "Q4_K": (4, 0, torch.float32, 32),
    "Q5_K": (8, 0, torch.float32, 32),
    "Q6_K": (8, 32, torch.float32, 16),
    "Q2_K": (4, 0, torch.float32, 16),
    "Q3_K": (4, 4, torch.float32, 16),
}


def blocks_of(type_name: str, n: int, k: int, seed: int = 0) -> AffineBlocks:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2, (n, 1)) + 0.2).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name.endswith("_K"):
        raw = k_quant_bytes(values, qtype)
    else:
        raw = gguf.quants.quantize(values, qtype)
    return decode_blocks(np.asarray(raw).reshape(-1), type_name, (n, k), groups_of_16=True)


@pytest.mark.parametrize("type_name", list(LAYOUTS))
def test_layout_and_exact_dequantization(type_name: str) -> None:
    blocks = blocks_of(type_name, 24, 256)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    bits, offset, scale_dtype, group = LAYOUTS[type_name]
    assert (packed.bits, packed.offset, packed.scales.dtype) == (bits, offset, scale_dtype)
    assert packed.group_size == group and packed.scales.shape == (24, 256 // group)
    assert (packed.mins is None) == (offset != 0)
    assert packed.codes.dtype == torch.int32 and packed.codes.shape == (24, 256 * bits // 32)
    dense = dequantize_into(packed, torch.empty(24 * 256 + 5, device=DEVICE))
    assert torch.equal(dense.cpu(), blocks.dequantize())


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q2_K", "Q3_K"])
@pytest.mark.parametrize("shape", [(40, 256), (20, 1280)])  # K past one 1024 slice
def test_gemv_matches_the_dequantized_weight(type_name: str, shape: tuple[int, int]) -> None:
    n, k = shape
    blocks = blocks_of(type_name, n, k, seed=n)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    x = torch.randn(1, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    out = gguf_gemv(x, packed, bias)
    ref = x.double().cpu() @ blocks.dequantize().double().T + bias.double().cpu()
    assert out.shape == (1, n) and rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gemv_pads_a_half_lane_group(type_name: str) -> None:
    """K = 96: 4-bit codes fill one and a half 64-column lane groups (zero codes pad the
    rest), 8-bit codes three 32-column ones."""
    blocks = blocks_of(type_name, 12, 96, seed=3)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    assert packed.codes.shape == (12, -(-96 // packed.span) * 8)  # 2 lane groups, or 3
    x = torch.randn(1, 96, device=DEVICE)
    ref = x.double().cpu() @ blocks.dequantize().double().T
    for config in (None, (8, 64, 1, 1), (16, 128, 2, 2)):
        assert rel_error(gguf_gemv(x, packed, None, config), ref) < 1e-5, config
    assert torch.equal(dequantize_into(packed, torch.empty(12 * 96, device=DEVICE)).cpu(),
                       blocks.dequantize())  # fmt: skip


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q3_K"])
@pytest.mark.parametrize("config", [None, (16, 256, 2, 2), (8, 1024, 1, 1)])
def test_gemv_unmasked_tiles_match_the_dequantized_weight(type_name, config) -> None:
    """Shapes the tiles divide take the kernel's unmasked path (llama-3-8b's do)."""
    blocks = blocks_of(type_name, 32, 2048, seed=7)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    x = torch.randn(1, 2048, device=DEVICE)
    out = gguf_gemv(x, packed, None, config)
    ref = x.double().cpu() @ blocks.dequantize().double().T
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q8_0"])
@pytest.mark.parametrize(
    ("shape", "config"),
    [
        ((36, 1280), (8, 128, 1, 2, 3)),  # masked rows and slices; 10 slices in 3 programs
        ((32, 2048), (16, 256, 2, 2, 2)),  # unmasked: llama-3-8b's shapes take this path
        ((32, 2048), (8, 512, 1, 3, 8)),  # more programs than slices: 4 of one slice each
    ],
)
def test_split_k_gemv_sums_the_parts_and_resets_its_counts(type_name, shape, config) -> None:
    """Each row block's columns over several programs: the same result (bitwise, whichever
    program finishes last) on every call, so the counts are back at zero after each."""
    n, k = shape
    blocks = blocks_of(type_name, n, k, seed=k)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    x = torch.randn(1, k, device=DEVICE)
    bias = torch.randn(n, device=DEVICE)
    ref = x.double().cpu() @ blocks.dequantize().double().T + bias.double().cpu()
    first = gguf_gemv(x, packed, bias, config)
    assert rel_error(first, ref) < 1e-5
    assert torch.equal(gguf_gemv(x, packed, bias, config), first)
    plain = config[:4]
    assert rel_error(gguf_gemv(x, packed, bias, plain), ref) < 1e-5
    int8_config = (config[0], 512, config[2], 3, config[4])  # narrower: refused on the GPU
    int8 = gguf_gemv_int8(x, packed, bias, int8_config)
    assert rel_error(int8, int8_reference(x, blocks) + bias.double().cpu()) < 1e-4
    assert torch.equal(gguf_gemv_int8(x, packed, bias, int8_config), int8)


@pytest.mark.cuda  # the interpreter computes narrow slices right, and is not refused
def test_int8_gemv_refuses_narrow_slices_on_the_gpu() -> None:
    blocks = blocks_of("Q4_0", 16, 256)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    with pytest.raises(ValueError, match="block_k >= 512"):
        gguf_gemv_int8(torch.randn(1, 256, device=DEVICE), packed, None, (8, 256, 1, 3))


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs")
def test_split_k_gemv_replays_from_a_cuda_graph() -> None:
    """The default tiles of llama-3-8b's o projection split 4 ways: a graph of three calls
    (the counts reset between them) gives the eager results bitwise, replay after replay."""
    blocks = blocks_of("Q4_0", 4096, 4096, seed=1)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    assert default_gemv_config(packed).split_k == 4
    x = torch.randn(3, 4096, device=DEVICE, dtype=torch.bfloat16)
    eager = [gguf_gemv(x[i : i + 1], packed) for i in range(3)]  # also makes the workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [gguf_gemv(x[i : i + 1], packed) for i in range(3)]
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(out, ref) for out, ref in zip(outs, eager, strict=True))


def test_split_k_refuses_more_parts_than_its_workspace(monkeypatch) -> None:
    from pagedlm_cuda.kernels import split_k as module

    blocks = blocks_of("Q4_0", 16, 256)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    monkeypatch.setattr(module, "SPLIT_PARTIALS", 31)
    with pytest.raises(ValueError, match="split workspace"):
        gguf_gemv(torch.randn(1, 256, device=DEVICE), packed, None, (8, 64, 1, 1, 2))


def test_words_hold_their_columns_in_lane_groups() -> None:
    """Slot i of word w in lane group g is column 64 g + 8 i + w (4-bit codes), in byte
    i % 4 of the word, its high nibble for slots 4-7."""
    codes = torch.arange(128, dtype=torch.uint8).remainder(16).view(1, 128)
    codes[0, 64:] = torch.arange(64, dtype=torch.uint8) // 4
    words = pack_words(codes, 4)[0]
    for g in range(2):
        for w in range(8):
            for i in range(8):
                expected = int(codes[0, 64 * g + 8 * i + w])
                position = 8 * (i % 4) + 4 * (i // 4)
                assert (int(words[8 * g + w]) >> position) & 15 == expected, (g, w, i)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_K", "Q6_K", "Q2_K"])
@pytest.mark.parametrize("rows", [2, 17, 40])
def test_tiled_gemm_matches_the_dequantized_weight(type_name: str, rows: int) -> None:
    blocks = blocks_of(type_name, 72, 512, seed=rows)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    x = torch.randn(rows, 512, device=DEVICE)
    out = gguf_gemm(x, packed)
    ref = x.double().cpu() @ blocks.dequantize().double().T
    # tf32 tensor-core products on the GPU; exact float32 in the interpreter.
    assert out.shape == (rows, 72) and rel_error(out, ref) < 2e-3


def test_layer_kernel_routes_each_row_count_and_keeps_its_results() -> None:
    blocks = blocks_of("Q4_1", 48, 128, seed=5)
    bias = torch.randn(48, device=DEVICE)
    kernel = GgufCudaLinear(blocks, bias, DEVICE, DenseScratch(), max_tiled_rows=4)
    dense = blocks.dequantize().double()
    for rows in (1, 3, 9):  # GEMV, tiled GEMM, dequantize + F.linear
        x = torch.randn(rows, 128, device=DEVICE)
        ref = x.double().cpu() @ dense.T + bias.double().cpu()
        assert rel_error(kernel(x), ref) < 2e-3, rows
    assert kernel.scratch.buffer is not None and kernel.scratch.buffer.numel() == 48 * 128


def test_refuses_what_it_cannot_compute() -> None:
    blocks = blocks_of("Q4_0", 16, 64)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    with pytest.raises(ValueError, match="features"):
        gguf_gemv(torch.randn(1, 32, device=DEVICE), packed)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_blocks(
            torch.zeros(2, 40, dtype=torch.uint8), torch.ones(2, 1), torch.ones(2, 1), DEVICE
        )


def int8_reference(x: torch.Tensor, blocks: AffineBlocks) -> torch.Tensor:
    """What ``gguf_gemv_int8`` computes, in float64 from float32 parts: x rounded to int8
    per 32 columns (scale max|x| / 127) times the codes' part of the weight; the stored
    minimums times x itself, an implicit ``-offset * scale`` times the rounded x."""
    groups = x.float().cpu().view(-1, 32)
    amax = groups.abs().amax(dim=1, keepdim=True)
    # Tensor over tensor: a number over a tensor is a reciprocal times it in torch, an
    # ulp off at times, which moves ties; round half to even, as the kernel does.
    inverse = torch.full_like(amax, 127.0) / amax.clamp_min(1e-30)
    q = torch.round(groups * inverse)
    xq = (q.double() * (amax * (1.0 / 127.0)).double()).view(1, -1)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, torch.device("cpu"))
    scales = blocks.scales.double().repeat_interleave(blocks.group_size, dim=1)
    codes = blocks.codes.double()
    if packed.mins is None:
        return xq @ ((codes - packed.offset) * scales).T
    mins = blocks.mins.double().repeat_interleave(blocks.group_size, dim=1)
    return xq @ (codes * scales).T + x.double().cpu() @ mins.T


@pytest.mark.parametrize(
    ("type_name", "shape"),
    [(t, shape) for t in LAYOUTS for shape in [(40, 256), (20, 1280)]]
    + [(t, (12, 96)) for t in LAYOUTS if not t.endswith("_K")],  # K-quants: 256-column blocks
)
def test_int8_gemv_matches_x_rounded_to_int8(type_name: str, shape: tuple[int, int]) -> None:
    """Against x rounded to int8 per group: the integer dots, scales and sums are exact
    (float32 sums). Against the exact product: the rounding's own error, about 1e-2."""
    n, k = shape
    blocks = blocks_of(type_name, n, k, seed=n + k)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    x = torch.randn(1, k, device=DEVICE)
    x[0, :32] = 0.0  # an all-zero group (scale 0)
    bias = torch.randn(n, device=DEVICE)
    out = gguf_gemv_int8(x, packed, bias)
    assert out.shape == (1, n)
    ref = int8_reference(x, blocks) + bias.double().cpu()
    assert rel_error(out, ref) < 1e-4
    exact = x.double().cpu() @ blocks.dequantize().double().T + bias.double().cpu()
    rounding = rel_error(ref, exact)
    assert 0 < rounding < 3e-2 and rel_error(out, exact) < 1.01 * rounding


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q8_0", "Q6_K", "Q2_K", "Q3_K"])
@pytest.mark.parametrize("config", [None, (8, 512, 1, 1), (16, 1024, 2, 1)])
def test_int8_gemv_tiles(type_name: str, config) -> None:
    """Unmasked tiles (llama-3-8b's shapes take them) and masked rows (N = 36)."""
    for n in (32, 36):
        blocks = blocks_of(type_name, n, 2048, seed=11)
        packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
        x = torch.randn(1, 2048, device=DEVICE) * 3
        out = gguf_gemv_int8(x, packed, None, config)
        assert rel_error(out, int8_reference(x, blocks)) < 1e-4, (n, config)


def test_dp4a_emulation_takes_unsigned_and_signed_bytes() -> None:
    """The interpreter's dp4a: a's bytes unsigned, b's signed (the GPU's ``dp4a.u32.s32``)."""

    @triton.jit
    def kernel(a_ptr, b_ptr, c_ptr, out_ptr, EMULATE: tl.constexpr):
        i = tl.arange(0, 8)
        a, b, c = tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i)
        tl.store(out_ptr + i, dp4a(a, b, c, EMULATE))

    rng = np.random.default_rng(0)
    a_bytes = rng.integers(0, 256, (8, 4), dtype=np.uint8)
    b_bytes = rng.integers(-128, 128, (8, 4), dtype=np.int8)
    c = rng.integers(-1000, 1000, 8).astype(np.int32)
    expected = c + (a_bytes.astype(np.int64) * b_bytes.astype(np.int64)).sum(1)
    as_words = [torch.from_numpy(v.view(np.int32).reshape(8)) for v in (a_bytes, b_bytes)]
    args = [t.to(DEVICE) for t in (*as_words, torch.from_numpy(c))]
    out = torch.empty(8, dtype=torch.int32, device=DEVICE)
    kernel[(1,)](*args, out, EMULATE=DEVICE.type != "cuda")
    assert out.cpu().tolist() == expected.tolist()


def test_layer_kernel_takes_the_int8_gemv_when_asked(monkeypatch) -> None:
    blocks = blocks_of("Q4_0", 48, 128, seed=9)
    x = torch.randn(1, 128, device=DEVICE)
    plain = GgufCudaLinear(blocks, None, DEVICE, DenseScratch())
    monkeypatch.setenv("PAGEDLM_GGUF_INT8_GEMV", "1")
    int8 = GgufCudaLinear(blocks, None, DEVICE, DenseScratch())
    assert torch.equal(plain(x), gguf_gemv(x, plain.packed))
    assert torch.equal(int8(x), gguf_gemv_int8(x, int8.packed))
    assert not torch.equal(int8(x), plain(x))


@pytest.mark.parametrize(
    ("type_name", "shape", "config", "magnitude"),
    [
        ("Q4_0", (40, 256), None, 1.0),
        ("Q4_1", (20, 1280), None, 1e5),  # masked slices
        ("Q4_K", (36, 1280), (8, 128, 1, 2, 3), 1.0),  # masked rows, split over 3 programs
        ("Q4_0", (32, 1024), (16, 256, 2, 2), 1e5),  # unmasked
        ("Q4_1", (12, 96), (8, 64, 1, 1), 1.0),  # half a lane group of zero codes
    ],
)
def test_half_products_stay_within_the_bf16_outputs_rounding(
    type_name, shape, config, magnitude
) -> None:
    """float16 products on bf16 x (and a bias): the result is as close to the float64
    product as the exact float32 kernel's (both rounded to bf16 at the end), and x as large
    as 1e5 does not overflow the float16 sums (x is scaled by 2^-8 before them)."""
    n, k = shape
    blocks = blocks_of(type_name, n, k, seed=n + k)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    x = (torch.randn(1, k) * magnitude).to(torch.bfloat16).to(DEVICE)
    assert takes_half_products(x, packed)
    bias = torch.randn(n).to(torch.bfloat16).to(DEVICE)
    ref = x.double().cpu() @ blocks.dequantize().double().T + bias.double().cpu()
    half = gguf_gemv_half(x, packed, bias, config)
    exact = gguf_gemv(x, packed, bias, config)
    assert half.dtype == torch.bfloat16 and torch.isfinite(half).all()
    assert rel_error(half, ref) < rel_error(exact, ref) + 1.5e-3


def test_half_products_differ_from_the_exact_ones_only_in_rounding() -> None:
    """In float16 x and output (11 significant bits), where the bf16 rounding does not hide
    it: the half products' error is a few of the output's units, and not zero (they did
    run)."""
    blocks = blocks_of("Q4_0", 32, 1024, seed=5)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    x = torch.randn(1, 1024, device=DEVICE, dtype=torch.float16)
    ref = x.double().cpu() @ blocks.dequantize().double().T
    half, exact = gguf_gemv_half(x, packed), gguf_gemv(x, packed)
    assert not torch.equal(half, exact)
    assert rel_error(exact, ref) < 5e-4 and rel_error(half, ref) < 1.5e-3


@pytest.mark.parametrize(
    ("type_name", "dtype"),
    [("Q4_0", torch.float32), ("Q8_0", torch.bfloat16), ("Q3_K", torch.bfloat16)],
)
def test_half_products_leave_other_layers_to_the_exact_gemv(type_name, dtype) -> None:
    """float32 x, 8-bit codes and scales per 16 columns keep ``gguf_gemv``'s products."""
    blocks = blocks_of(type_name, 24, 256, seed=2)
    packed = pack_blocks(blocks.codes, blocks.scales, blocks.mins, DEVICE)
    x = torch.randn(1, 256, device=DEVICE).to(dtype)
    assert not takes_half_products(x, packed)
    assert torch.equal(gguf_gemv_half(x, packed), gguf_gemv(x, packed))


def test_layer_kernel_takes_half_products_unless_asked_for_exact_ones(monkeypatch) -> None:
    blocks = blocks_of("Q4_0", 48, 128, seed=9)
    x = torch.randn(1, 128, device=DEVICE, dtype=torch.bfloat16)
    default = GgufCudaLinear(blocks, None, DEVICE, DenseScratch())
    monkeypatch.setenv("PAGEDLM_GGUF_EXACT_GEMV", "1")
    exact = GgufCudaLinear(blocks, None, DEVICE, DenseScratch())
    assert torch.equal(default(x), gguf_gemv_half(x, default.packed))
    assert torch.equal(exact(x), gguf_gemv(x, exact.packed))
