"""MoE layers with shared experts (Qwen2-MoE, DeepSeek-V2/V3) under TP=2: the shared and
routed experts' partial sums meet in one all-reduce, and the run equals one worker's
(DeepSeek's latent attention, with its replicated down-projections, included)."""

from __future__ import annotations

import pytest
from parity import assert_same_run, one_worker_run, processes_gone, run_and_stop

from model_executor.test_zoo_models_deepseek import MLA
from tiny_checkpoints import save_random_model

QWEN2_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "mlp_only_layers": [1],
}
DEEPSEEK = {
    **MLA,
    "q_lora_rank": 24,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}
CASES = {
    "deepseek_v3": ("DeepseekV3Config", DEEPSEEK),
    "deepseek_v2": ("DeepseekV2Config", {**DEEPSEEK, "topk_method": "greedy"}),
    "qwen2_moe": ("Qwen2MoeConfig", QWEN2_MOE),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_matches_one_worker(tmp_path, name) -> None:
    config_class, overrides = CASES[name]
    save_random_model(tmp_path, config_class, overrides)
    expected = one_worker_run(tmp_path)
    outputs, pids = run_and_stop(tmp_path, tensor_parallel_size=2)
    assert_same_run(outputs, expected)
    assert processes_gone(pids)
