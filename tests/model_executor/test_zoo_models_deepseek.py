"""DeepSeek-V2/V3 (multi-head latent attention, DeepSeek MoE) against transformers, and the
routing options they added to ``select_experts``.

Logits of tiny random checkpoints, fp32, through the paged CPU backend: one prefill step
for all prompts, then the same prompts as a prefix chunk followed by single-token decode
steps (which read the cache). Each checkpoint has a dense first layer and MoE layers with
8 experts in groups, shared experts and a routed scaling factor; values (16 wide) are
narrower than keys (16 + 8), so the value padding is exercised. V3's router bias is
random (transformers starts it at zero), so it changes which experts are chosen.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_executor.test_tensor_parallel import assert_two_ranks_match_one
from model_utils import PagedRunner
from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.moe import (
    ExpertGroups,
    ExpertRouting,
    FusedMoE,
    select_experts,
)
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM
from tiny_checkpoints import PROMPT_LENS, hf_logits, model_config, random_prompts, save_random_model

BLOCK_SIZE = 4
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 0.9,
    "mscale_all_dim": 0.7,
}
MLA = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
KEY_HEAD_DIM = 16 + 8

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # V2-Lite's shape: q_proj, V2's group-limited greedy routing (3 experts from 2 groups:
    # with no more experts than groups, the best-expert group rule never binds).
    "v2_lite": (
        "DeepseekV2Config",
        {
            **MLA,
            "num_experts_per_tok": 3,
            "q_lora_rank": None,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 2,
            "routed_scaling_factor": 1.5,
        },
    ),
    # V2: q through its latent, YaRN with mscale_all_dim in the softmax scale.
    "v2_yarn": (
        "DeepseekV2Config",
        {
            **MLA,
            "q_lora_rank": 24,
            "topk_method": "greedy",
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.0,
            "rope_parameters": YARN,
        },
    ),
    # V3: sigmoid + bias, groups by their top two, renormalized then scaled; YaRN.
    "v3": (
        "DeepseekV3Config",
        {
            **MLA,
            "q_lora_rank": 24,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "rope_parameters": YARN,
        },
    ),
    # V3 with rotary halves (rope_interleave false), two groups of four, unnormalized.
    "v3_halves": (
        "DeepseekV3Config",
        {
            **MLA,
            "num_hidden_layers": 2,
            "q_lora_rank": None,
            "rope_interleave": False,
            "n_group": 2,
            "topk_group": 1,
            "n_shared_experts": 2,
            "routed_scaling_factor": 0.5,
            "norm_topk_prob": False,
        },
    ),
}


def save_deepseek(
    path: Path, config_class: str, overrides: dict[str, Any], cache_head_dim: bool = True
) -> torch.nn.Module:
    """``save_random_model`` with V3's router biases random too; with ``cache_head_dim``
    config.json's head_dim becomes the key head size (transformers writes
    qk_rope_head_dim, its rotary width; pagedlm reads qk_nope + qk_rope either way)."""
    hf_model = save_random_model(path, config_class, overrides)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, buffer in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.1, 0.1, generator=generator)
    hf_model.save_pretrained(path)
    if not cache_head_dim:
        return hf_model
    config_file = path / "config.json"
    raw = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**raw, "head_dim": KEY_HEAD_DIM}))
    return hf_model


def paged_runner(model: torch.nn.Module) -> PagedRunner:
    return PagedRunner(model, len(PROMPT_LENS), max(PROMPT_LENS), BLOCK_SIZE)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_deepseek(path, *CASES[request.param])
    prompts = random_prompts()
    expected = [hf_logits(hf_model, p) for p in prompts]
    return load_model(model_config(path), torch.device("cpu")), prompts, expected, path


def test_prefill_matches_transformers(case) -> None:
    model, prompts, expected, _ = case
    got = paged_runner(model).step([(i, 0, p) for i, p in enumerate(prompts)])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_chunk_then_decodes_read_the_cache(case) -> None:
    model, prompts, expected, _ = case
    got = paged_runner(model).chunk_then_decodes(prompts)
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_stacked_experts_and_prediction_layers_load(case, tmp_path: Path) -> None:
    """The same weights with each layer's experts stacked as transformers holds them in
    memory (``experts.gate_up_proj`` [E, 2I, hidden], ``experts.down_proj``) and a
    multi-token-prediction layer past ``num_hidden_layers``, as the reference ships it."""
    model, prompts, expected, path = case
    tensors = load_file(path / "model.safetensors")
    stacked: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            stacked[name] = tensor
    for layer in range(model.arch.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.weight" not in tensors:
            continue
        experts = range(MLA["n_routed_experts"])
        gate_up = [
            torch.cat(
                [tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]]
            )
            for e in experts
        ]
        stacked[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        stacked[f"{prefix}.down_proj"] = torch.stack(
            [tensors[f"{prefix}.{e}.down_proj.weight"] for e in experts]
        )
    mtp_layer = model.arch.num_hidden_layers
    stacked[f"model.layers.{mtp_layer}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(stacked, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    restacked = load_model(model_config(tmp_path), torch.device("cpu"))
    got = paged_runner(restacked).step([(i, 0, p) for i, p in enumerate(prompts)])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_cache_head_size_is_the_key_head_size() -> None:
    """config.json's head_dim (transformers writes qk_rope_head_dim there; hub configs have
    none) gives way to qk_nope + qk_rope, the heads the cache holds; an override that
    names another size is refused."""
    raw = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        **{k: MLA[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")},
        "v_head_dim": 16,
        "head_dim": 8,
    }
    arch = ArchConfig.from_hf_dict(raw)
    assert arch.head_dim == KEY_HEAD_DIM == 24
    DeepseekV2ForCausalLM(arch)
    with pytest.raises(ValueError, match="head_dim=8"):
        DeepseekV2ForCausalLM(dataclasses.replace(arch, head_dim=8))


# ---- routing -------------------------------------------------------------------------


def _reference_routing(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    routing: ExpertRouting,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token in float64, experts sorted by id."""
    all_weights, all_ids = [], []
    for row in logits.double():
        scores = row.sigmoid() if routing.scoring == "sigmoid" else row.softmax(-1)
        choice = scores + (0 if bias is None else bias.double())
        allowed = list(range(len(row)))
        groups = routing.groups
        if groups is not None:
            size = len(row) // groups.num_groups
            members = [list(range(g * size, (g + 1) * size)) for g in range(groups.num_groups)]
            best = {"max": 1, "top2_sum": 2}[groups.score]
            group_scores = [
                sum(sorted((choice[i].item() for i in m), reverse=True)[:best]) for m in members
            ]
            ranked = sorted(range(groups.num_groups), key=lambda g: -group_scores[g])
            kept = [members[g] for g in ranked[: groups.topk_groups]]
            allowed = sorted(i for m in kept for i in m)
        ids = sorted(sorted(allowed, key=lambda i: choice[i].item(), reverse=True)[:top_k])
        weights = scores[ids]
        if renormalize:
            weights = weights / weights.sum()
        all_weights.append(weights * routing.scaling_factor)
        all_ids.append(torch.tensor(ids))
    return torch.stack(all_weights), torch.stack(all_ids)


ROUTINGS = {
    "v2_groups": (ExpertRouting(groups=ExpertGroups(4, 2, "max"), scaling_factor=1.5), False),
    "v3": (
        ExpertRouting(
            scoring="sigmoid",
            correction_bias=True,
            groups=ExpertGroups(4, 2, "top2_sum"),
            scaling_factor=2.5,
        ),
        True,
    ),
    "sigmoid_bias_only": (ExpertRouting(scoring="sigmoid", correction_bias=True), False),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_routing_matches_a_per_token_reference(name: str) -> None:
    routing, renormalize = ROUTINGS[name]
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=generator)
    bias = torch.randn(8, generator=generator) * 0.3 if routing.correction_bias else None
    weights, ids = select_experts(logits, 3, renormalize, routing, bias)
    ids, order = ids.sort(dim=-1)
    want_weights, want_ids = _reference_routing(logits, 3, renormalize, routing, bias)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.gather(1, order).double(), want_weights)


def test_group_limit_changes_the_choice() -> None:
    """Experts 0 and 1 (group 0) score best alone, but group 1 holds the best pair: the
    top-two sum keeps group 1, the best expert keeps group 0."""
    scores = torch.tensor([[0.9, 0.0, 0.8, 0.8]])
    logits = torch.logit(scores.clamp(1e-4, 1 - 1e-4))
    by_pair = ExpertRouting(scoring="sigmoid", groups=ExpertGroups(2, 1, "top2_sum"))
    by_best = ExpertRouting(scoring="sigmoid", groups=ExpertGroups(2, 1, "max"))
    assert select_experts(logits, 2, False, by_pair)[1].sort().values.tolist() == [[2, 3]]
    assert select_experts(logits, 2, False, by_best)[1].sort().values.tolist() == [[0, 1]]
    plain = ExpertRouting(scoring="sigmoid")
    assert select_experts(logits, 2, False, plain)[1].sort().values.tolist() == [[0, 2]]


def test_correction_bias_chooses_but_does_not_weigh() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([5.0, 0.0, 0.0, 0.0])
    routing = ExpertRouting(scoring="sigmoid", correction_bias=True, scaling_factor=2.0)
    weights, ids = select_experts(logits, 1, False, routing, bias)
    assert ids.tolist() == [[0]]
    torch.testing.assert_close(weights, torch.tensor([[0.5 * 2.0]]))
    weights, _ = select_experts(logits, 2, True, routing, bias)
    torch.testing.assert_close(weights.sum(-1), torch.tensor([2.0]))  # renormalized, scaled


def test_default_routing_is_the_plain_softmax_top_k() -> None:
    logits = torch.randn(33, 6, generator=torch.Generator().manual_seed(4))
    for renormalize in (True, False):
        plain = select_experts(logits, 2, renormalize)
        explicit = select_experts(logits, 2, renormalize, ExpertRouting())
        assert torch.equal(plain[0], explicit[0]) and torch.equal(plain[1], explicit[1])


def test_bad_groups_are_explained() -> None:
    with pytest.raises(ValueError, match="n_group=3 must divide the 8 experts"):
        FusedMoE(8, 2, 16, 8, False, routing=ExpertRouting(groups=ExpertGroups(3, 1)))
    with pytest.raises(ValueError, match="num_experts_per_tok=3 cannot be chosen"):
        FusedMoE(8, 3, 16, 8, False, routing=ExpertRouting(groups=ExpertGroups(4, 1)))
    with pytest.raises(ValueError, match="scoring_func='tanh'"):
        FusedMoE(8, 2, 16, 8, False, routing=ExpertRouting(scoring="tanh"))


def test_correction_bias_stays_float32_in_a_bfloat16_model() -> None:
    torch.set_default_dtype(torch.bfloat16)
    try:
        moe = FusedMoE(8, 2, 16, 8, True, routing=ExpertRouting(correction_bias=True))
    finally:
        torch.set_default_dtype(torch.float32)
    assert moe.w13.dtype == torch.bfloat16
    assert moe.e_score_correction_bias is not None
    assert moe.e_score_correction_bias.dtype == torch.float32


# ---- tensor parallel -----------------------------------------------------------------


@pytest.mark.slow
def test_two_ranks_match_one(tmp_path: Path) -> None:
    """Heads split over two gloo ranks (q and kv_b column-parallel, o_proj row-parallel),
    experts and shared experts sliced: the logits of one worker."""
    model_dirs = []
    for name in ("v2_lite", "v3"):
        save_deepseek(tmp_path / name, *CASES[name])
        model_dirs.append(str(tmp_path / name))
    assert_two_ranks_match_one(model_dirs, tmp_path, atol=1e-5, rtol=0)


def latent_model(path: Path) -> torch.nn.Module:
    model = load_model(model_config(path), torch.device("cpu"))
    model.enable_latent_kv()
    return model


def test_latent_cache_matches_transformers(case) -> None:
    """The latent form (``kv_b_proj`` folded into queries and outputs, one vector of
    ``kv_lora_rank + qk_rope_head_dim`` cached per token and layer): the same logits,
    for a prefill and for decodes that read the cache."""
    _, prompts, expected, path = case
    model = latent_model(path)
    runner = paged_runner(model)
    key_cache, value_cache = runner.kv_cache.layer(0)
    assert key_cache is value_cache  # one tensor per layer
    assert key_cache.shape[-2:] == (1, MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"])
    assert not any("kv_b_proj" in name for name, _ in model.named_parameters())
    got = runner.step([(i, 0, p) for i, p in enumerate(prompts)])
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)
    got = paged_runner(model).chunk_then_decodes(prompts)
    torch.testing.assert_close(torch.cat(got), torch.cat(expected), atol=1e-4, rtol=0)


def test_latent_cache_in_bf16_stays_near_the_expanded_form(tmp_path: Path) -> None:
    """bf16: the latent form rounds other products than the expanded one (the query's
    fold, the output's); its logits stay as close to float32 as the expanded form's."""
    save_deepseek(tmp_path, *CASES["v3"])
    prompts = random_prompts()
    reference = torch.cat(
        paged_runner(load_model(model_config(tmp_path), torch.device("cpu"))).step(
            [(i, 0, p) for i, p in enumerate(prompts)]
        )
    )
    errors = []
    for latent in (False, True):
        config = model_config(tmp_path, dtype=torch.bfloat16)
        model = load_model(config, torch.device("cpu"))
        if latent:
            model.enable_latent_kv()
        error = (torch.cat(paged_runner(model).chunk_then_decodes(prompts)) - reference).abs()
        errors.append((error.max().item(), error.mean().item()))
    (expanded_max, expanded_mean), (latent_max, latent_mean) = errors
    assert latent_max <= 2 * expanded_max and latent_mean <= 1.5 * expanded_mean, errors


def test_the_latent_switch_keeps_every_tensor_on_the_model_device(tmp_path: Path) -> None:
    """``enable_latent_kv`` runs after loading, outside the loader's device context: the
    folded maps and the new attention layer's scale buffers must land beside the weights
    (here the meta device stands in for a GPU)."""
    save_deepseek(tmp_path, *CASES["v3"])
    arch = ArchConfig.from_directory(tmp_path)
    with torch.device("meta"):
        model = DeepseekV2ForCausalLM(arch)
    model.enable_latent_kv()
    devices = {t.device.type for t in (*model.parameters(), *model.buffers())}
    assert devices == {"meta"}, devices


def test_in_place_weight_loads_reach_the_folded_maps(tmp_path: Path) -> None:
    """After the switch ``kv_b_proj`` is gone; a later in-place ``load_weights`` of the
    checkpoint's names (an RL trainer's update through ``collective_rpc``) folds the new
    ``kv_b_proj.weight`` into the latent maps: the model then computes what a model loaded
    from the new weights computes."""
    save_deepseek(tmp_path, *CASES["v2_lite"])
    tensors = load_file(tmp_path / "model.safetensors")
    changed = {
        name: tensor * 1.5 if name.endswith("kv_b_proj.weight") else tensor
        for name, tensor in tensors.items()
    }
    updated = latent_model(tmp_path)
    loaded = updated.load_weights(changed.items())
    assert "model.layers.0.self_attn.kv_b_proj.weight" in loaded
    save_file(changed, tmp_path / "model.safetensors")
    prompts = random_prompts()
    want = paged_runner(load_model(model_config(tmp_path), torch.device("cpu"))).step(
        [(i, 0, p) for i, p in enumerate(prompts)]
    )
    got = paged_runner(updated).step([(i, 0, p) for i, p in enumerate(prompts)])
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=1e-4, rtol=0)


def test_an_fp8_kv_b_proj_with_a_static_input_scale_folds_exactly(tmp_path: Path) -> None:
    """An FP8 ``kv_b_proj`` is folded from its codes times their scales: its product with
    the identity would quantize the identity too, by the static input scale of an FP8
    checkpoint (measured 4% off at 0.03)."""
    from pagedlm.model_executor.quantization.fp8 import dequantize, quantize_layer

    save_deepseek(tmp_path, *CASES["v2_lite"])
    model = load_model(model_config(tmp_path), torch.device("cpu"))
    attention = model.model.layers[0].self_attn
    layer = attention.kv_b_proj
    with torch.no_grad():
        quantize_layer(layer)
        layer.input_scale = torch.nn.Parameter(torch.tensor([0.03]), requires_grad=False)
    weight = dequantize(layer.weight, layer.weight_scale)  # [heads * (nope + v), rank]
    model.enable_latent_kv()
    maps = weight.view(-1, MLA["qk_nope_head_dim"] + MLA["v_head_dim"], MLA["kv_lora_rank"])
    torch.testing.assert_close(attention.w_uk, maps[:, : MLA["qk_nope_head_dim"]], atol=0, rtol=0)
    torch.testing.assert_close(
        attention.w_uv, maps[:, MLA["qk_nope_head_dim"] :].transpose(1, 2), atol=0, rtol=0
    )


def test_in_place_loads_of_quantized_kv_b_proj_are_refused(tmp_path: Path) -> None:
    save_deepseek(tmp_path, *CASES["v2_lite"])
    model = latent_model(tmp_path)
    codes = torch.zeros(64, MLA["kv_lora_rank"], dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="take float weights"):
        model.load_weights([("model.layers.0.self_attn.kv_b_proj.weight", codes)])


def test_checkpoint_kv_scales_dropped_by_the_switch_are_logged(tmp_path: Path, caplog) -> None:
    """Scales calibrated for the expanded keys do not fit the latent ones: the latent cache
    keeps 1.0 and says so."""
    save_deepseek(tmp_path, *CASES["v2_lite"])
    model = load_model(model_config(tmp_path), torch.device("cpu"))
    model.model.layers[1].self_attn.attn.k_scale.fill_(0.5)
    with caplog.at_level("WARNING", logger="pagedlm.model_executor.models.deepseek_v2"):
        model.enable_latent_kv()
    assert "Layer 1: the checkpoint's KV cache scales" in caplog.text
    assert "Layer 0" not in caplog.text
    assert float(model.model.layers[1].self_attn.attn.k_scale) == 1.0
