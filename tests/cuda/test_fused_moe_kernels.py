"""The capture-safe MoE path (``kernels/fused_moe.py``): the routing's alignment into expert
blocks, the grouped GEMMs against ``FusedMoE``'s own eager path and a float64 reference
(all experts local, or a slice of them as under expert parallelism), its installation
(an installed layer no longer keeps the model from CUDA graphs), and on a GPU
Mixtral/DeepSeek-V2-Lite shapes replayed from a CUDA graph with new routings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton.language as tl
from torch import nn
from triton_env import DEVICE, ON_GPU, rel_error, tolerance

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.moe import HOST_GROUPING, FusedMoE, select_experts
from pagedlm.model_executor.models.deepseek_moe import DeepseekMoE
from pagedlm_cuda.fused_layers import FUSED_MOE_ENV, FusedExperts, install_fused_kernels
from pagedlm_cuda.kernels.fused_moe import (
    FusedMoEConfig,
    align_to_blocks,
    block_capacity,
    fused_experts,
)

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 2, 32, 16
# Small tiles keep the interpreter fast; 16 rows is the MMA's smallest side on a GPU.
TINY = FusedMoEConfig(block_m=16, block_n=16, block_k=16, num_warps=1, stages=1)


@pytest.fixture(autouse=True)
def _fused_moe_on(monkeypatch) -> None:
    """The path is on by default; these tests hold it on whatever the environment says."""
    monkeypatch.delenv(FUSED_MOE_ENV, raising=False)


@pytest.fixture(autouse=True)
def _bfloat16_rounds_to_nearest(monkeypatch) -> None:
    """Triton 3.6's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest
    even), which shrank the fused path's results by 2% against torch's: round through
    torch for this module's tests."""
    if ON_GPU:
        return
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return original(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


def _moe(
    dtype: torch.dtype,
    expert_start: int = 0,
    num_local: int | None = None,
    num_experts: int = NUM_EXPERTS,
    top_k: int = TOP_K,
    hidden: int = HIDDEN,
    intermediate: int = INTERMEDIATE,
    seed: int = 0,
) -> FusedMoE:
    """A FusedMoE with random weights on DEVICE; every rank-local expert's weights are the
    same as the whole layer's for one seed."""
    moe = FusedMoE(
        num_experts, top_k, hidden, intermediate, True, expert_start=expert_start,
        num_local_experts=num_local,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    full_w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator)
    full_w2 = torch.randn(num_experts, hidden, intermediate, generator=generator)
    local = slice(expert_start, expert_start + moe.num_local_experts)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(num_experts, hidden, generator=generator))
        moe.w13.copy_(full_w13[local] / hidden**0.5)
        moe.w2.copy_(full_w2[local] / intermediate**0.5)
    return moe.to(device=DEVICE, dtype=dtype)


def _float64_reference(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token in float64 over the routing the layer chooses."""
    weights, expert_ids = select_experts(moe.gate(x), moe.top_k, moe.renormalize)
    out = torch.zeros(x.shape, dtype=torch.float64)
    w13, w2 = moe.w13.double().cpu(), moe.w2.double().cpu()
    inter = w2.shape[-1]
    for token in range(x.shape[0]):
        xt = x[token].double().cpu()
        for weight, expert in zip(weights[token].tolist(), expert_ids[token].tolist()):
            local = expert - moe.expert_start
            if not 0 <= local < moe.num_local_experts:
                continue
            gate_up = w13[local] @ xt
            hidden = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[token] += weight * (w2[local] @ hidden)
    return out


# ---- alignment ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "start", "num_local", "block_m"),
    [
        (1, 2, 8, 0, 8, 16),
        (17, 2, 8, 0, 8, 16),
        (40, 3, 8, 2, 4, 4),  # a middle rank's experts
        (5, 6, 64, 60, 4, 16),  # the last rank's
        (64, 1, 4, 0, 4, 8),  # one crowded expert, idle ones
        (50, 4, 64, 0, 64, 16),  # four chunks of 64 pairs
        (30, 8, 256, 64, 128, 16),  # eight chunks of 32 pairs, half the experts elsewhere
        (40, 8, 256, 0, 256, 32),  # twenty chunks of 16 pairs: the layout takes 16 at a time
    ],
)
def test_alignment_places_every_local_pair_once(
    num_tokens, top_k, num_experts, start, num_local, block_m
) -> None:
    torch.manual_seed(num_tokens)
    choices = [torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)]
    expert_ids = torch.stack(choices).to(DEVICE)
    if num_experts == 4:
        expert_ids[: num_tokens // 2 + 5] = 1
    blocks = align_to_blocks(expert_ids, start, num_local, block_m)
    num_pairs = num_tokens * top_k
    capacity = block_capacity(num_pairs, num_local, block_m)
    pair_ids = blocks.pair_ids.cpu()
    block_experts = blocks.block_experts.cpu()
    assert pair_ids.dtype == block_experts.dtype == torch.int32
    assert pair_ids.shape == (capacity,) and block_experts.shape == (capacity // block_m,)

    flat = expert_ids.flatten().cpu() - start
    local_pairs = torch.arange(num_pairs)[(flat >= 0) & (flat < num_local)]
    placed = pair_ids[pair_ids != num_pairs]
    assert sorted(placed.tolist()) == local_pairs.tolist()  # each local pair once, no other

    total = int(blocks.padded_total.item())
    counts = torch.bincount(flat[local_pairs], minlength=num_local)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    used = total // block_m
    assert (block_experts[used:] == -1).all() and (block_experts[:used] >= 0).all()
    assert (pair_ids[total:] == num_pairs).all()
    assert torch.equal(block_experts[:used], block_experts[:used].sort().values)
    for block in range(used):  # a block's pairs are its expert's, in pair order, padding last
        rows = pair_ids[block * block_m : (block + 1) * block_m]
        real = rows[rows != num_pairs]
        assert (flat[real.long()] == block_experts[block]).all()
        assert torch.equal(rows[: len(real)], real) and torch.equal(real, real.sort().values)
    assert block_experts[:used].unique().numel() == (counts > 0).sum()


def test_capacity_bound_is_reached_and_never_exceeded() -> None:
    """One pair for each of 8 experts and 16-row blocks: 8 blocks, the bound exactly."""
    expert_ids = torch.arange(8, device=DEVICE).view(4, 2)
    blocks = align_to_blocks(expert_ids, 0, 8, 16)
    assert blocks.pair_ids.numel() == block_capacity(8, 8, 16) == 8 * 16
    assert int(blocks.padded_total.item()) == 8 * 16
    assert blocks.block_experts.tolist() == list(range(8))


# ---- grouped GEMMs against FusedMoE's eager path --------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize(("start", "num_local"), [(0, None), (2, 4)], ids=["all", "ep"])
def test_fused_path_matches_the_eager_one(dtype, num_tokens, start, num_local) -> None:
    moe = _moe(dtype, start, num_local, seed=num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x = x.to(dtype)
    with torch.no_grad():
        eager = moe.routed_partial(x)
        kernel = FusedExperts(moe)
        moe.set_kernel(lambda x, w, e: fused_experts(x, moe.w13, moe.w2, w, e, start, 8, TINY))
        fused = moe.routed_partial(x)
        moe.set_kernel(kernel, capturable=True)
        default_tiles = moe.routed_partial(x)
        reference = _float64_reference(moe, x)
    assert fused.shape == eager.shape and fused.dtype == dtype
    assert rel_error(fused, reference) < tolerance(dtype)
    assert rel_error(eager, reference) < tolerance(dtype)
    assert rel_error(fused, eager) < tolerance(dtype)
    assert rel_error(default_tiles, reference) < tolerance(dtype)
    if num_local is not None and num_tokens > 1:  # some pairs are other ranks'
        expert_ids = select_experts(moe.gate(x), TOP_K, True)[1]
        assert ((expert_ids < start) | (expert_ids >= start + num_local)).any()


@pytest.mark.parametrize("num_tokens", [1, 17])
@pytest.mark.parametrize(("start", "num_local"), [(0, None), (2, 4)], ids=["all", "ep"])
def test_fp8_experts_match_their_eager_path(num_tokens, start, num_local) -> None:
    """E4M3 experts (``FusedMoE.quantize_fp8``): codes widened to bf16 in the kernel, each
    column times its row's scale, against the eager path's float32 products."""
    moe = _moe(torch.bfloat16, start, num_local, seed=num_tokens)
    moe.quantize_fp8()
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    x = x.to(torch.bfloat16)
    assert FusedExperts.takes(moe)
    with torch.no_grad():
        eager = moe.routed_partial(x)
        scales = (moe.w13_scale, moe.w2_scale)
        moe.set_kernel(
            lambda x, w, e: fused_experts(x, moe.w13, moe.w2, w, e, start, 8, TINY, scales)
        )
        fused = moe.routed_partial(x)
        moe.set_kernel(FusedExperts(moe), capturable=True)
        default_tiles = moe.routed_partial(x)
    assert fused.dtype == torch.bfloat16
    assert rel_error(fused, eager) < tolerance(torch.bfloat16)
    assert rel_error(default_tiles, eager) < tolerance(torch.bfloat16)
    with pytest.raises(ValueError, match="E4M3 experts need w13_scale"):
        fused_experts(x, moe.w13, moe.w2, *select_experts(moe.gate(x), TOP_K, True))


def test_expert_slices_sum_to_the_whole_layer() -> None:
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.no_grad():
        parts = []
        for start, count in [(None, None), (0, 3), (3, 5)]:
            moe = _moe(torch.float32, start or 0, count, seed=7)
            moe.set_kernel(
                lambda x, w, e, m=moe: fused_experts(
                    x, m.w13, m.w2, w, e, m.expert_start, NUM_EXPERTS, TINY
                )
            )
            parts.append(moe.routed_partial(x))
    whole, first, second = parts
    assert first.abs().sum() > 0 and second.abs().sum() > 0
    assert rel_error(first + second, whole) < 1e-5


def test_a_block_of_many_rows_and_wide_tiles() -> None:
    """One expert takes every token (57 pairs: four 16-row blocks, the last padded)."""
    moe = _moe(torch.float32, hidden=48, intermediate=40, seed=3)
    x = torch.randn(57, 48, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    weights = torch.ones(57, 1, device=DEVICE)
    expert_ids = torch.full((57, 1), 5, device=DEVICE)
    config = FusedMoEConfig(16, 32, 32, 1, 1)
    out = fused_experts(x, moe.w13, moe.w2, weights, expert_ids, 0, None, config)
    gate_up = x.double() @ moe.w13[5].double().T
    hidden = F.silu(gate_up[:, :40]) * gate_up[:, 40:]
    assert rel_error(out, hidden @ moe.w2[5].double().T) < tolerance(torch.float32)


def test_many_experts_over_several_chunks() -> None:
    """64 experts, top-6 (DeepSeek-V2-Lite's routing at a tiny width): 120 pairs counted
    and placed in two chunks, most experts with one or two pairs."""
    moe = _moe(torch.float32, num_experts=64, top_k=6, seed=11)
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    with torch.no_grad():
        eager = moe.routed_partial(x)
        moe.set_kernel(lambda x, w, e: fused_experts(x, moe.w13, moe.w2, w, e, 0, 64, TINY))
        fused = moe.routed_partial(x)
    assert rel_error(fused, _float64_reference(moe, x)) < tolerance(torch.float32)
    assert rel_error(fused, eager) < tolerance(torch.float32)


def test_shared_experts_keep_working() -> None:
    """DeepSeek's layer adds its shared experts to the routed partial it now gets from the
    grouped GEMM."""
    raw = {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
           "n_shared_experts": 1, "topk_method": "greedy"}  # fmt: skip
    arch = ArchConfig(
        architecture="DeepseekV2ForCausalLM", vocab_size=8, hidden_size=HIDDEN,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, raw=raw,
    )  # fmt: skip
    torch.manual_seed(5)
    moe = DeepseekMoE(arch)
    for param in moe.parameters():
        nn.init.normal_(param, std=0.2)
    moe.to(DEVICE, torch.bfloat16)
    x = torch.randn(5, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = moe(x)
        assert FusedExperts.takes(moe)
        moe.set_kernel(FusedExperts(moe), capturable=True)
        fused = moe(x)
    assert rel_error(fused, eager) < tolerance(torch.bfloat16)


def test_float32_experts_keep_the_eager_path() -> None:
    """Float32 products are exact in the kernel only through FMA dots (``ieee``), slower
    than the eager path's cuBLAS matmuls: float32 layers are not taken."""
    moe = _moe(torch.float32)
    install_fused_kernels(moe)
    assert moe.kernel is None and moe.uncapturable == HOST_GROUPING


# ---- installation ---------------------------------------------------------------------


def test_installed_layers_are_capturable_and_others_are_not() -> None:
    model = nn.Sequential(_moe(torch.bfloat16), _moe(torch.bfloat16))
    assert all(m.uncapturable == HOST_GROUPING for m in model)
    model[1].set_kernel(lambda x, w, e: torch.zeros_like(x))  # some kernel of its own
    install_fused_kernels(model)
    assert isinstance(model[0].kernel, FusedExperts) and model[0].uncapturable is None
    assert not isinstance(model[1].kernel, FusedExperts)
    assert model[1].uncapturable == HOST_GROUPING  # not said to be capturable
    assert not any(getattr(m, "uncapturable", None) for m in nn.Sequential(model[0]).modules())
    model[0].set_kernel(None)  # back to expert_groups: uncapturable again
    assert model[0].uncapturable == HOST_GROUPING and model[0].kernel is None
    assert FusedMoE.uncapturable == HOST_GROUPING  # the class kept its reason


def test_weights_it_cannot_take_keep_the_eager_path() -> None:
    moe = _moe(torch.bfloat16)
    with torch.no_grad():
        moe.w13 = nn.Parameter(moe.w13.to(torch.float8_e4m3fn), requires_grad=False)
    assert not FusedExperts.takes(moe)
    install_fused_kernels(moe)
    assert moe.kernel is None and moe.uncapturable == HOST_GROUPING


@pytest.mark.parametrize(("switch", "fused"), [(None, True), ("1", True), ("0", False)])
def test_the_switch(monkeypatch, switch, fused) -> None:
    """On by default; ``PAGEDLM_FUSED_MOE=0`` keeps the host grouping (and eager steps)."""
    if switch is None:
        monkeypatch.delenv(FUSED_MOE_ENV, raising=False)
    else:
        monkeypatch.setenv(FUSED_MOE_ENV, switch)
    moe = _moe(torch.bfloat16)
    install_fused_kernels(moe)
    if fused:
        assert isinstance(moe.kernel, FusedExperts) and moe.uncapturable is None
    else:
        assert moe.kernel is None and moe.uncapturable == HOST_GROUPING


def test_bad_shapes_are_explained() -> None:
    moe = _moe(torch.float32)
    x = torch.randn(3, HIDDEN, device=DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.long, device=DEVICE)
    weights = torch.ones(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match="one float dtype"):
        fused_experts(x.bfloat16(), moe.w13, moe.w2, weights, ids)
    with pytest.raises(ValueError, match=r"w2 must be \[experts, hidden, I\]"):
        fused_experts(x, moe.w13, moe.w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match=r"expert_ids must be \[T, top_k\] for T=3"):
        fused_experts(x, moe.w13, moe.w2, weights, ids[:2])
    with pytest.raises(ValueError, match=r"weights must have expert_ids' shape \(3, 2\)"):
        fused_experts(x, moe.w13, moe.w2, weights[:, :1], ids)


# ---- GPU: real shapes, CUDA graphs -----------------------------------------------------

GPU_SHAPES = {  # (experts, top_k, hidden, intermediate)
    "mixtral": (8, 2, 4096, 14336),
    "deepseek_v2_lite": (64, 6, 2048, 1408),
}


def _gpu_moe(name: str, **layout) -> FusedMoE:
    experts, top_k, hidden, inter = GPU_SHAPES[name]
    with torch.device("cuda"):
        moe = FusedMoE(experts, top_k, hidden, inter, True, **layout)
        generator = torch.Generator("cuda").manual_seed(0)
        with torch.no_grad():
            moe.gate.weight.normal_(std=hidden**-0.5, generator=generator)
            moe.w13.normal_(std=hidden**-0.5, generator=generator)
            moe.w2.normal_(std=inter**-0.5, generator=generator)
    return moe.to(torch.bfloat16)


def _fused_and_eager(moe: FusedMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed partial through the installed kernels, then through ``expert_groups``
    with the same router kernel (so near-tied experts are chosen alike)."""
    install_fused_kernels(moe)
    assert isinstance(moe.kernel, FusedExperts)
    with torch.no_grad():
        fused = moe.routed_partial(x)
        moe.set_kernel(None)
        eager = moe.routed_partial(x)
    return fused, eager


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(GPU_SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_gpu_shapes_match_the_eager_path(name: str, num_tokens: int) -> None:
    moe = _gpu_moe(name)
    x = torch.randn(num_tokens, moe.w13.shape[-1], device="cuda", dtype=torch.bfloat16)
    fused, eager = _fused_and_eager(moe, x)
    assert rel_error(fused, eager) < tolerance(torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_expert_parallel_slice_matches_the_eager_path() -> None:
    moe = _gpu_moe("deepseek_v2_lite", expert_start=16, num_local_experts=16)
    x = torch.randn(33, 2048, device="cuda", dtype=torch.bfloat16)
    fused, eager = _fused_and_eager(moe, x)
    assert eager.abs().sum() > 0
    assert rel_error(fused, eager) < tolerance(torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_gpu_graph_replays_new_routings(name: str) -> None:
    """Captured once, replayed with inputs that route differently: the eager result each
    time (a host wait or a routing-dependent shape would fail the capture or replay the
    captured routing)."""
    moe = _gpu_moe(name)
    install_fused_kernels(moe)
    assert moe.uncapturable is None
    static_x = torch.randn(16, moe.w13.shape[-1], device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        moe(static_x)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = moe(static_x)
    routings = []
    for seed in range(3):
        generator = torch.Generator("cuda").manual_seed(100 + seed)
        x = torch.randn(static_x.shape, device="cuda", generator=generator).to(torch.bfloat16)
        if seed == 2:
            x[:] = x[:1]  # every token to the same experts
        static_x.copy_(x)
        graph.replay()
        with torch.no_grad():
            routings.append(select_experts(moe.gate(x), moe.top_k, True)[1])
            moe.set_kernel(None)
            eager = moe(x)
            moe.set_kernel(FusedExperts(moe), capturable=True)
        assert rel_error(static_out, eager) < tolerance(torch.bfloat16)
    assert not torch.equal(routings[0], routings[1])


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_gpu_engine_captures_moe_models_with_the_eager_tokens(tiny_checkpoint, arch) -> None:
    """Through LLM: the MoE model now gets CUDA graphs (decode steps and the prefill
    pieces), and its greedy tokens are those of the same requests run eagerly."""
    from pagedlm import LLM, SamplingParams

    path = str(tiny_checkpoint(arch))
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 9, 17, 30, 41, 64]
    requests = [{"prompt_token_ids": torch.randint(384, (n,), generator=generator).tolist()}
                for n in lengths]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def generate(**kwargs) -> tuple[list[list[int]], bool]:
        llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256, **kwargs)
        outs = llm.generate(requests, params, use_tqdm=False)
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        captured = runner.graph_runner is not None
        del llm, runner
        torch.cuda.empty_cache()
        return [list(o.outputs[0].token_ids) for o in outs], captured

    with_graphs, captured = generate()
    assert captured
    eager, captured = generate(enforce_eager=True)
    assert not captured
    assert with_graphs == eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_experts_give_a_token_the_same_bits_in_any_batch(dtype) -> None:
    """``batch_invariant``: one tiling whatever the pair count (the default's row blocks
    grow with it) and slot-order sums, so a token alone and among 40 agree to the bit."""
    moe = _moe(dtype, top_k=3, seed=21)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(22)).to(DEVICE, dtype)
    weights, ids = select_experts(moe.gate(x), moe.top_k, True)

    def experts(rows: slice) -> torch.Tensor:
        return fused_experts(
            x[rows], moe.w13, moe.w2, weights[rows], ids[rows], batch_invariant=True
        )

    whole = experts(slice(None))
    for token in (0, 17, 39):
        assert torch.equal(experts(slice(token, token + 1)), whole[token : token + 1])
    assert rel_error(whole, _float64_reference(moe, x)) < tolerance(dtype)
