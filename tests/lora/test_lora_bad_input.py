"""Bad adapters fail their own request with a clear ValueError, before the engine sees
it; the engine keeps serving (the same adapter directory, fixed, works afterwards)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import save_file

from pagedlm import LLM, LoRARequest, SamplingParams
from pagedlm.config import ArchConfig
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.exceptions import RequestFailedError
from pagedlm.lora.peft_format import check_adapter
from peft_adapters import LLAMA_MODULES, edit_config, lora_llm, make_adapter, rename_tensors
from tiny_checkpoints import save_random_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    make_adapter(base, root / "good", LLAMA_MODULES, rank=8)
    llm = LLM(
        str(base), skip_tokenizer_init=True, enable_lora=True, max_lora_rank=8, num_kv_blocks=32
    )
    return llm, base, root


def _generate(llm: LLM, lora: LoRARequest | None) -> list[int]:
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9]}]
    outs = llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=[lora, None])
    return outs[0].outputs[0].token_ids


def test_bad_adapters_fail_only_their_request(engine, tmp_path):
    llm, base, root = engine
    good = LoRARequest("good", 1, str(root / "good"))
    before = _generate(llm, good)

    make_adapter(base, tmp_path / "r16", LLAMA_MODULES, rank=16)
    make_adapter(base, tmp_path / "unknown", LLAMA_MODULES)
    rename_tensors(tmp_path / "unknown", "layers.0.self_attn.q_proj", "layers.0.self_attn.lm_proj")
    save_random_model(tmp_path / "other", "LlamaConfig", {"intermediate_size": 96})
    make_adapter(tmp_path / "other", tmp_path / "mismatch", LLAMA_MODULES)
    make_adapter(base, tmp_path / "dora", LLAMA_MODULES)
    edit_config(tmp_path / "dora", use_dora=True)
    make_adapter(base, tmp_path / "truncated", LLAMA_MODULES)
    weights = tmp_path / "truncated" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # a copy cut short
    make_adapter(base, tmp_path / "no_alpha", LLAMA_MODULES)
    edit_config(tmp_path / "no_alpha", lora_alpha=None)
    cases = {
        "r16": "LoRA rank 16 is greater than max_lora_rank 8; start the engine with --max-lora-rank 16",
        "unknown": "target module 'model.layers.0.self_attn.lm_proj' does not exist",
        "mismatch": r"mlp\.\w+_proj\.lora_[AB]\.weight has shape \[(8, )?96(, 8)?\] but "
        r"LlamaForCausalLM with r=8 needs \[(8, )?128(, 8)?\]; the adapter was trained for "
        "another base model",
        "missing": "does not exist or is not a directory",
        "dora": "DoRA adapters are not supported",
        "truncated": "adapter_model.safetensors cannot be read",
        "no_alpha": "lora_alpha must be a number, got None",
    }
    for index, (name, message) in enumerate(cases.items(), start=2):
        with pytest.raises(ValueError, match=message):
            _generate(llm, LoRARequest(name, index, str(tmp_path / name)))
    with pytest.raises(ValueError, match="lora_int_id 1 already names the adapter"):
        _generate(llm, LoRARequest("other", 1, str(tmp_path / "r16")))
    assert not llm.llm_engine.has_unfinished_requests()
    assert _generate(llm, good) == before


def test_lora_needs_enable_lora_and_a_supported_model(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("llama")
    make_adapter(base, tmp_path / "a", LLAMA_MODULES)
    llm = LLM(str(base), skip_tokenizer_init=True, num_kv_blocks=16)
    with pytest.raises(ValueError, match="LoRA is not enabled; start the engine with enable_lora"):
        _generate(llm, LoRARequest("a", 1, str(tmp_path / "a")))
    with pytest.raises(ValueError, match="enable_lora does not support GPT2LMHeadModel"):
        EngineArgs(model=str(tiny_checkpoint("gpt2")), enable_lora=True).create_engine_config()


def test_moe_expert_adapters_are_refused(tiny_checkpoint, tmp_path):
    import torch

    arch = ArchConfig.from_directory(tiny_checkpoint("mixtral"))
    adapter = tmp_path / "moe"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["w1"]})
    )
    prefix = "base_model.model.model.layers.0.block_sparse_moe.experts.0.w1"
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.zeros(4, arch.hidden_size),
            f"{prefix}.lora_B.weight": torch.zeros(arch.intermediate_size, 4),
        },
        str(adapter / "adapter_model.safetensors"),
    )
    with pytest.raises(ValueError, match="adapters for MoE experts"):
        check_adapter(str(adapter), arch, 16)
    edit_config(adapter, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="adapters for MoE experts"):
        check_adapter(str(adapter), arch, 16)


def test_an_id_keeps_its_path_however_many_adapters_came_after(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """The checker forgets old adapters' checked configs (a bounded cache) but never which
    path an id names (one adapter per id, until ``remove_lora``), however many adapters
    came between."""
    from pagedlm.config import LoRAConfig
    from pagedlm.lora import frontend
    from pagedlm.lora.frontend import AdapterChecker

    monkeypatch.setattr(frontend, "_MAX_REMEMBERED", 2)
    base = tiny_checkpoint("llama")
    for name in ("a", "b", "c", "d"):
        make_adapter(base, tmp_path / name, LLAMA_MODULES)
    checker = AdapterChecker(LoRAConfig(), ArchConfig.from_directory(base))
    for index, name in enumerate("abcd", start=1):
        checker.check(LoRARequest(name, index, str(tmp_path / name)))
    assert len(checker._checked) == 2  # the configs of ids 1 and 2 were let go
    checker.check(LoRARequest("a", 1, str(tmp_path / "a")))  # checked again, same path
    with pytest.raises(ValueError, match="lora_int_id 2 already names the adapter"):
        checker.check(LoRARequest("other", 2, str(tmp_path / "c")))
    checker.forget(2)
    checker.check(LoRARequest("other", 2, str(tmp_path / "c")))  # removed: free again


def test_target_modules_the_model_lacks_are_ignored(tiny_checkpoint, tmp_path):
    """PEFT trains with ``target_modules`` entries that match nothing (a list shared across
    architectures); the weights file says what is adapted, and vLLM serves such an
    adapter. It was refused for naming a module the model lacks."""
    base = tiny_checkpoint("llama")
    make_adapter(base, tmp_path / "a", ["q_proj", "v_proj"])
    edit_config(tmp_path / "a", target_modules=["q_proj", "v_proj", "c_attn", "query_key_value"])
    config = check_adapter(str(tmp_path / "a"), ArchConfig.from_directory(base), 8)
    assert {m.rpartition(".")[2] for m in config.modules} == {"q_proj", "v_proj"}


@pytest.mark.parametrize("suffix", ["bin", "pt"])
def test_pickled_adapters_are_read_as_vllm_reads_them(engine, tmp_path, suffix):
    """PEFT's older adapter_model.bin (and .pt) hold the same tensors, pickled; vLLM reads
    them with torch.load(weights_only=True). They were refused ("resave it with
    safetensors"). A garbage one is a ValueError naming the file, the engine unharmed."""
    import shutil

    import torch
    from safetensors.torch import load_file

    llm, _, root = engine
    lora_id = 20 if suffix == "bin" else 30  # the engine is the module's: ids stay apart
    expected = _generate(llm, LoRARequest("good", 1, str(root / "good")))
    pickled = tmp_path / "pickled"
    shutil.copytree(root / "good", pickled)
    weights = pickled / "adapter_model.safetensors"
    torch.save(load_file(str(weights)), pickled / f"adapter_model.{suffix}")
    weights.unlink()
    assert _generate(llm, LoRARequest("pickled", lora_id, str(pickled))) == expected
    (pickled / f"adapter_model.{suffix}").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match=f"adapter_model.{suffix} cannot be read"):
        _generate(llm, LoRARequest("garbage", lora_id + 1, str(pickled)))
    assert _generate(llm, LoRARequest("good", 1, str(root / "good"))) == expected


def test_an_adapter_is_read_before_its_request_enters_the_engine(tiny_checkpoint, tmp_path):
    """The workers read an adapter's tensors at the first step that needed them: files
    deleted (or damaged) after the front end's check failed that whole step, the requests
    beside it included. The engine core now has them read as the request is added: one
    that cannot be read is refused alone, and one read then serves its request whatever
    happens to its files afterwards."""
    base = tiny_checkpoint("llama")
    for name in ("first", "copy", "gone"):
        make_adapter(base, tmp_path / name, LLAMA_MODULES, seed=3)  # the same weights
    llm = lora_llm(base, max_loras=2)
    engine = llm.llm_engine
    prompts = {"base": {"prompt_token_ids": [9]}, "copy": {"prompt_token_ids": [5, 6, 7]}}
    first = LoRARequest("first", 1, str(tmp_path / "first"))
    alone = {
        "base": llm.generate([prompts["base"]], PARAMS, use_tqdm=False)[0],
        "copy": llm.generate([prompts["copy"]], PARAMS, use_tqdm=False, lora_request=first)[0],
    }
    engine.add_request("base", prompts["base"], PARAMS)
    copy = LoRARequest("copy", 2, str(tmp_path / "copy"))
    engine.add_request("copy", prompts["copy"], PARAMS, lora_request=copy)
    shutil.rmtree(tmp_path / "copy")  # after its request was added: read already
    gone = LoRARequest("gone", 3, str(tmp_path / "gone"))
    engine.input_processor.adapters.check(gone)  # the front end's check passed, then
    shutil.rmtree(tmp_path / "gone")
    with pytest.raises(ValueError, match="No adapter found for"):
        engine.add_request("gone", {"prompt_token_ids": [5]}, PARAMS, lora_request=gone)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert finished == {key: output.outputs[0].token_ids for key, output in alone.items()}
    engine.shutdown()


def test_an_adapter_unreadable_when_a_step_needs_it_fails_only_its_requests(
    tiny_checkpoint, tmp_path
):
    """An adapter read once, dropped from the workers' host cache, then deleted, is read
    again by the step that needs it. That read failed the whole step (the call's other
    requests too); now it fails the requests that name it (finish reason "error",
    ``RequestFailedError`` once the others finish with the tokens they have alone), and the
    blocks the step computed for them without the adapter are not hit later."""
    base = tiny_checkpoint("llama")
    make_adapter(base, tmp_path / "x", LLAMA_MODULES, seed=3)
    make_adapter(base, tmp_path / "x_ref", LLAMA_MODULES, seed=3)  # x's weights, elsewhere
    make_adapter(base, tmp_path / "y", LLAMA_MODULES, seed=4)
    x = LoRARequest("x", 1, str(tmp_path / "x"))
    y = LoRARequest("y", 2, str(tmp_path / "y"))
    llm = lora_llm(base, max_loras=1, max_cpu_loras=1)
    prompts = [
        {"prompt_token_ids": [5, 6, 7]},
        {"prompt_token_ids": [9, 10]},
        {"prompt_token_ids": list(range(3, 43))},  # two full blocks of 16
    ]
    loras = [y, None, x]
    x_ref = LoRARequest("x_ref", 3, str(tmp_path / "x_ref"))
    alone = [
        llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=lora)[0].outputs[0]
        for prompt, lora in zip(prompts, [y, None, x_ref])
    ]
    engine = llm.llm_engine
    assert engine.add_lora(x) and engine.add_lora(y)  # max_cpu_loras=1: x left the host
    (tmp_path / "x").rename(tmp_path / "x_away")
    with pytest.raises(RequestFailedError, match="prompt 2 of the call") as failure:
        llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=loras)
    outputs = [output.outputs[0] for output in failure.value.outputs]
    assert [o.token_ids for o in outputs[:2]] == [o.token_ids for o in alone[:2]]
    assert outputs[2].finish_reason == "error"
    assert "LoRA adapter 'x' (lora_int_id 1) could not be read" in outputs[2].stop_reason
    assert "No adapter found for" in outputs[2].stop_reason
    (tmp_path / "x_away").rename(tmp_path / "x")  # back: its prompt's blocks were not kept
    again = llm.generate([prompts[2]], PARAMS, use_tqdm=False, lora_request=x)[0].outputs[0]
    assert again.token_ids == alone[2].token_ids
    engine.shutdown()
