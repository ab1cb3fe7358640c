"""load_format (auto / safetensors / gguf / dummy), dtype, remote code and the edge checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from pagedlm import LLM, SamplingParams
from pagedlm.config import ArchConfig, ModelConfig
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.loader.dummy import DUMMY_SCALE

TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    architectures=["LlamaForCausalLM"],
)


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    """A model directory that holds nothing but config.json."""
    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    return tmp_path


def dummy_model(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32):
    arch = ArchConfig.from_directory(path)
    config = ModelConfig(str(path), None, arch, dtype, 64, seed=seed, load_format="dummy")
    return load_model(config, torch.device("cpu"))


def test_dummy_weights_need_only_config_json(config_only: Path) -> None:
    model = dummy_model(config_only)
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.qkv_proj.weight"].shape == (64, 32)  # q 32 + k/v 16
    assert params["model.embed_tokens.weight"].shape == (128, 32)
    for name, param in params.items():
        assert torch.isfinite(param).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert param.abs().max() <= DUMMY_SCALE and param.std() > DUMMY_SCALE / 4, name


def test_dummy_weights_follow_the_seed_and_dtype(config_only: Path) -> None:
    first, again, other = (
        dummy_model(config_only),
        dummy_model(config_only),
        dummy_model(config_only, 1),
    )
    weight = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(first.get_parameter(weight), again.get_parameter(weight))
    assert not torch.equal(first.get_parameter(weight), other.get_parameter(weight))
    bf16 = dummy_model(config_only, dtype=torch.bfloat16)
    assert bf16.get_parameter(weight).dtype == torch.bfloat16
    torch.testing.assert_close(
        bf16.get_parameter(weight).float(), first.get_parameter(weight), rtol=1e-2, atol=1e-4
    )


def test_llm_generates_from_a_config_only_directory(config_only: Path) -> None:
    llm = LLM(model=str(config_only), load_format="dummy", skip_tokenizer_init=True,
              num_kv_blocks=16, max_model_len=64)  # fmt: skip
    outputs = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6, 7, 8]}],
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    assert [len(out.outputs[0].token_ids) for out in outputs] == [4, 4]


def test_config_only_directory_without_dummy_names_the_fix(config_only: Path) -> None:
    with pytest.raises(ValueError, match=r"no \*\.safetensors files.*load_format=\"dummy\""):
        EngineArgs(model=str(config_only)).create_engine_config()


def test_directory_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"has no config\.json"):
        EngineArgs(model=str(tmp_path), load_format="dummy").create_engine_config()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"load_format": "npcache"},
            "is not available in pagedlm: pagedlm reads PyTorch .bin files directly, without "
            "a numpy cache; use --load-format pt",
        ),
        ({"load_format": "nonsense"}, "load_format='nonsense' is unknown; use one of auto, "),
        ({"load_format": "gguf"}, "load_format='gguf' needs a .gguf file"),
        ({"quantization": "hqq"}, "quantization='hqq' is not supported"),
        ({"quantization": "bitsandbytes", "bnb_quant_type": "nf3"}, "bnb_quant_type='nf3'"),
        ({"revision": "main"}, "revision='main' applies to hub ids"),
        ({"dtype": "float64"}, "Unknown dtype 'float64'"),
    ],
)
def test_bad_loading_options(config_only: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(
            model=str(config_only), **{"load_format": "dummy", **kwargs}
        ).create_engine_config()


def test_safetensors_format_refuses_a_gguf(tmp_path: Path) -> None:
    gguf_file = tmp_path / "model.gguf"
    gguf_file.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="load_format='safetensors' needs a model directory"):
        EngineArgs(model=str(gguf_file), load_format="safetensors").create_engine_config()


def test_dtype_auto_follows_the_cpu_and_float32_on_request(tmp_path: Path) -> None:
    # On CPU "auto" means bf16 where the hardware has it, float32 elsewhere, whatever the
    # checkpoint's dtype (tests/cpu/test_cpu_dtype.py covers both kinds of CPU).
    from pagedlm_cpu.platform import has_native_bf16

    transformers.LlamaConfig(**TINY, dtype="bfloat16").save_pretrained(tmp_path)
    config, _ = EngineArgs(model=str(tmp_path), load_format="dummy").create_engine_config()
    assert config.model.dtype == (torch.bfloat16 if has_native_bf16() else torch.float32)
    config, _ = EngineArgs(
        model=str(tmp_path), load_format="dummy", dtype="float32"
    ).create_engine_config()
    assert config.model.dtype == torch.float32


def test_dtype_the_platform_cannot_run_is_refused(config_only: Path) -> None:
    # The CPU platform's supported dtypes are its own answer; float16 matmuls are not in it.
    from pagedlm.plugins.registry import select_platform

    platform = select_platform("cpu")
    if torch.float16 in platform.supported_dtypes:
        pytest.fail("the CPU platform was expected to refuse float16; update this test")
    with pytest.raises(ValueError, match=r"cannot run dtype torch\.float16; use one of"):
        EngineArgs(
            model=str(config_only), load_format="dummy", dtype="float16"
        ).create_engine_config()


def test_model_code_in_the_directory_is_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    (tmp_path / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    config = {**transformers.LlamaConfig(**TINY).to_dict(), "architectures": ["CustomForCausalLM"],
              "auto_map": {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    for trust in (False, True):
        with pytest.raises(ValueError, match=r"'CustomForCausalLM'.*never executes"):
            EngineArgs(
                model=str(tmp_path), load_format="dummy", trust_remote_code=trust
            ).create_engine_config()
    assert not marker.exists()


def test_the_cli_takes_the_load_formats_and_vllms_loaders_only(capsys) -> None:
    import argparse

    from pagedlm.engine.cli_args import add_engine_args
    from pagedlm.model_executor.loader import LOAD_FORMATS

    parser = add_engine_args(argparse.ArgumentParser())
    for load_format in LOAD_FORMATS:
        assert parser.parse_args(["--load-format", load_format]).load_format == load_format
    assert "{auto,safetensors,pt,gguf,dummy," in parser.format_help()
    # vLLM's loaders parse, to be refused at start naming the fix (test_bad_loading_options).
    assert parser.parse_args(["--load-format", "npcache"]).load_format == "npcache"
    with pytest.raises(SystemExit):
        parser.parse_args(["--load-format", "nonsense"])
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err
