"""Pre-quantized FP8 checkpoints, written here with safetensors from a tiny random llama:
compressed-tensors (per-channel weight scales, dynamic per-token activations) and vLLM's
``fp8`` layout (per-tensor weight scales, static input scales), read by the safetensors
loader and the model's own ``load_weights``."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_utils import full_logits
from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.quantization import fp8
from pagedlm_cpu.attention import CpuSdpaBackend
from tiny_checkpoints import model_config, random_prompts, save_random_model

_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.(\w+)_proj\.weight$")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("float-llama")
    save_random_model(path, "LlamaConfig", {"architectures": ["LlamaForCausalLM"]})
    return path


def write_fp8_checkpoint(
    source: Path,
    target: Path,
    layout: str,
    quantized: re.Pattern[str] = _LINEAR,
    ignore: tuple[str, ...] = ("lm_head",),
) -> dict[str, torch.Tensor]:
    """``source`` with the tensors ``quantized`` matches (its decoder linears) in E4M3
    (``layout``: "compressed-tensors" or "fp8"; ``ignore``: compressed-tensors' list of
    modules left float); returns the tensors written."""
    target.mkdir()
    state = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(3)
    for name in [n for n in state if quantized.match(n)]:
        weight = state[name]
        if layout == "compressed-tensors":
            codes, scales = fp8.quantize_rows(weight)  # scales [rows, 1], as llm-compressor
        else:
            scales = weight.abs().amax() / fp8.FP8_MAX  # one per tensor, a 0-d tensor
            codes = fp8.quantize_with_scale(weight, scales)
            state[name.removesuffix("weight") + "input_scale"] = 0.01 + 0.04 * torch.rand(
                (), generator=generator
            )
        state[name], state[name + "_scale"] = codes, scales
    save_file(state, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    if layout == "compressed-tensors":
        scheme = {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "symmetric": True, "dynamic": True},
        }  # fmt: skip
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": scheme},
            "ignore": list(ignore),
        }
    else:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (target / "config.json").write_text(json.dumps(config))
    return state


def test_compressed_tensors_checkpoint_equals_quantizing_at_load(
    float_checkpoint: Path, tmp_path: Path
) -> None:
    write_fp8_checkpoint(float_checkpoint, tmp_path / "ct", "compressed-tensors")
    config, _ = EngineArgs(
        model=str(tmp_path / "ct"), skip_tokenizer_init=True, dtype="float32"
    ).create_engine_config()
    assert config.model.quantization == "fp8"
    loaded = load_model(config.model, CPU)
    online = load_model(replace(model_config(float_checkpoint), quantization="fp8"), CPU)
    layers = {n: m for n, m in loaded.named_modules() if fp8.is_fp8_layer(m)}
    assert len(layers) == 8 and not hasattr(loaded.lm_head, "weight_scale")
    online_layers = dict(online.named_modules())
    for name, layer in layers.items():
        assert torch.equal(
            layer.weight.view(torch.uint8), online_layers[name].weight.view(torch.uint8)
        )
        assert torch.equal(layer.weight_scale, online_layers[name].weight_scale)
    backend, prompt = CpuSdpaBackend(CPU), random_prompts()[2]
    with torch.no_grad():
        got = full_logits(loaded, config.model.arch, backend, prompt)
        want = full_logits(online, config.model.arch, backend, prompt)
    assert torch.equal(got, want)


def test_vllm_fp8_checkpoint_keeps_each_projections_scale(
    float_checkpoint: Path, tmp_path: Path
) -> None:
    state = write_fp8_checkpoint(float_checkpoint, tmp_path / "fp8", "fp8")
    config, _ = EngineArgs(
        model=str(tmp_path / "fp8"), skip_tokenizer_init=True, dtype="float32"
    ).create_engine_config()
    model = load_model(config.model, CPU)
    qkv = model.model.layers[1].self_attn.qkv_proj
    prefix = "model.layers.1.self_attn."
    parts = [state[f"{prefix}{p}_proj.weight"].float() * state[f"{prefix}{p}_proj.weight_scale"]
             for p in "qkv"]  # fmt: skip
    torch.testing.assert_close(fp8.dequantize(qkv.weight, qkv.weight_scale), torch.cat(parts))
    input_scales = [state[f"{prefix}{p}_proj.input_scale"] for p in "qkv"]
    assert qkv.input_scale.item() == pytest.approx(max(s.item() for s in input_scales))
    reference = load_model(model_config(float_checkpoint), CPU)
    backend, prompt = CpuSdpaBackend(CPU), random_prompts()[2]
    with torch.no_grad():
        got = full_logits(model, config.model.arch, backend, prompt)
        want = full_logits(reference, config.model.arch, backend, prompt)
    # Static per-tensor activation scales chosen at random: coarser than per token.
    assert ((got - want).norm() / want.norm()).item() < 0.3


def test_llm_generates_from_an_fp8_checkpoint(float_checkpoint: Path, tmp_path: Path) -> None:
    write_fp8_checkpoint(float_checkpoint, tmp_path / "ct", "compressed-tensors")
    llm = LLM(str(tmp_path / "ct"), skip_tokenizer_init=True, dtype="float32",
              max_model_len=128, num_kv_blocks=32)  # fmt: skip
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "weight_block_size",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "int", "strategy": "block"}}
                },
            },
            "int8 compressed-tensors checkpoint uses 'block' weight scales",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}
                },
            },
            "'group' weight scales",
        ),
    ],
)
def test_unsupported_fp8_variants_are_refused_at_the_edge(
    float_checkpoint: Path, tmp_path: Path, quantization_config: dict, message: str
) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "model.safetensors").symlink_to(float_checkpoint / "model.safetensors")
    config = json.loads((float_checkpoint / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(target), skip_tokenizer_init=True).create_engine_config()


def test_a_mismatched_quantization_argument_is_refused(float_checkpoint: Path, tmp_path: Path):
    write_fp8_checkpoint(float_checkpoint, tmp_path / "ct", "compressed-tensors")
    with pytest.raises(ValueError, match="drop --quantization"):
        EngineArgs(
            model=str(tmp_path / "ct"), skip_tokenizer_init=True, quantization="bitsandbytes"
        ).create_engine_config()


@pytest.mark.parametrize("config_in", ["hf_quant_config.json", "config.json"])
def test_modelopt_fp8_checkpoint_loads_as_vllm_fp8(
    float_checkpoint: Path, tmp_path: Path, config_in: str
) -> None:
    """NVIDIA ModelOpt's "FP8": vLLM's fp8 tensors, its quantization in hf_quant_config.json
    (or config.json's quantization_config), KV scales as ``k_proj.k_scale``."""
    state = write_fp8_checkpoint(float_checkpoint, tmp_path / "vllm", "fp8")
    target = tmp_path / "modelopt"
    target.mkdir()
    state = dict(state)
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.self_attn."
        state[prefix + "k_proj.k_scale"] = torch.tensor(0.5 + layer)
        state[prefix + "v_proj.v_scale"] = torch.tensor(0.25 + layer)
    save_file(state, target / "model.safetensors")
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    del config["quantization_config"]
    quantization = {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8",
        "exclude_modules": ["lm_head"],
    }
    if config_in == "config.json":
        config["quantization_config"] = {"quant_method": "modelopt", **quantization}
    else:
        (target / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt"}, "quantization": quantization})
        )
    (target / "config.json").write_text(json.dumps(config))
    loaded_configs = [
        EngineArgs(model=str(path), skip_tokenizer_init=True, dtype="float32")
        .create_engine_config()[0]
        .model
        for path in (target, tmp_path / "vllm")
    ]
    assert loaded_configs[0].quantization == "fp8"
    modelopt, vllm_fp8 = (load_model(c, CPU) for c in loaded_configs)
    attention = [m for m in modelopt.modules() if hasattr(m, "k_scale") and hasattr(m, "v_scale")]
    assert [(a.k_scale.item(), a.v_scale.item()) for a in attention] == [(0.5, 0.25), (1.5, 1.25)]
    backend, prompt = CpuSdpaBackend(CPU), random_prompts()[2]
    with torch.no_grad():
        got = full_logits(modelopt, loaded_configs[0].arch, backend, prompt)
        want = full_logits(vllm_fp8, loaded_configs[1].arch, backend, prompt)
    assert torch.equal(got, want)
    EngineArgs(
        model=str(target), skip_tokenizer_init=True, quantization="modelopt"
    ).create_engine_config()


_MIXTRAL_QUANTIZED = re.compile(
    r"model\.layers\.\d+\.(self_attn\.\w+_proj|block_sparse_moe\.experts\.\d+\.w\d)\.weight$"
)


@pytest.mark.parametrize("layout", ["compressed-tensors", "fp8"])
def test_fp8_experts_load_and_match_quantizing_at_load(tmp_path: Path, layout: str) -> None:
    """A Mixtral whose attention and expert weights are E4M3 in the file (llm-compressor's
    per-channel scales, or vLLM's per-tensor ones with static input scales): the experts
    are E4M3 after loading (quantized again per row); per-channel checkpoints give exactly
    the logits of quantizing the float model at load."""
    from pagedlm.model_executor.layers.moe import FusedMoE

    source = tmp_path / "float"
    save_random_model(
        source,
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    )
    target = tmp_path / layout
    write_fp8_checkpoint(source, target, layout, _MIXTRAL_QUANTIZED, ("lm_head", "re:.*gate$"))
    checkpoint_config, _ = EngineArgs(
        model=str(target), skip_tokenizer_init=True, dtype="float32"
    ).create_engine_config()
    model = load_model(checkpoint_config.model, CPU)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.is_fp8 for m in experts)
    reference = load_model(replace(model_config(source), quantization="fp8"), CPU)
    backend = CpuSdpaBackend(CPU)
    arch = checkpoint_config.model.arch
    with torch.no_grad():
        for prompt in random_prompts()[:2]:
            got = full_logits(model, arch, backend, prompt)
            want = full_logits(reference, arch, backend, prompt)
            if layout == "compressed-tensors":  # the same codes and scales
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:  # static input scales, per-tensor codes quantized again
                assert ((got - want).norm() / want.norm()).item() < 0.15


_DEEPSEEK_QUANTIZED = re.compile(
    r"model\.layers\.\d+\.(self_attn\.\w+_(proj|mqa)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?\w+_proj)\.weight$"
)
"""llm-compressor's FP8-dynamic recipe on DeepSeek: every linear layer but the LM head and
the routers, so also the latent projections every rank holds whole (``q_a_proj``,
``kv_a_proj_with_mqa``)."""


def test_deepseek_fp8_checkpoint_matches_quantizing_at_load(tmp_path: Path) -> None:
    """A DeepSeek-V3 checkpoint with every decoder linear in E4M3 (per-channel scales):
    its replicated latent projections load too (they have no sharding loader), and the
    logits are those of quantizing the float model at load."""
    from model_executor.test_zoo_models_deepseek import CASES, save_deepseek
    from pagedlm.model_executor.models.deepseek_v2 import ReplicatedLinear

    config_class, overrides = CASES["v3"]
    source = tmp_path / "float"
    save_deepseek(source, config_class, overrides)
    target = tmp_path / "ct"
    state = write_fp8_checkpoint(
        source, target, "compressed-tensors", _DEEPSEEK_QUANTIZED, ("lm_head", "re:.*mlp.gate$")
    )
    assert any(name.endswith("q_a_proj.weight_scale") for name in state)
    checkpoint_config, _ = EngineArgs(
        model=str(target), skip_tokenizer_init=True, dtype="float32"
    ).create_engine_config()
    model = load_model(checkpoint_config.model, CPU)
    replicated = [m for m in model.modules() if isinstance(m, ReplicatedLinear)]
    assert replicated and all(fp8.is_fp8_layer(m) for m in replicated)
    reference = load_model(replace(model_config(source), quantization="fp8"), CPU)
    backend = CpuSdpaBackend(CPU)
    arch = checkpoint_config.model.arch
    with torch.no_grad():
        for prompt in random_prompts()[:2]:
            got = full_logits(model, arch, backend, prompt)
            want = full_logits(reference, arch, backend, prompt)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
