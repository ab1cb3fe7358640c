"""The names vLLM programs import from ``vllm`` exist here too: the engine classes and
their arguments (``AsyncEngineArgs``/``AsyncLLMEngine`` as vLLM's V1 aliases them), and the
prompt TypedDicts, whose dicts the engine takes as they are."""

from __future__ import annotations

import subprocess
import sys


def test_the_names_import_without_loading_torch():
    code = (
        "import sys, pagedlm\n"
        "from pagedlm import TextPrompt, TokensPrompt, PromptType\n"
        "assert 'torch' not in sys.modules\n"
        "from pagedlm import AsyncEngineArgs, AsyncLLMEngine, EngineArgs, LLMEngine, AsyncLLM\n"
        "assert AsyncEngineArgs is EngineArgs and AsyncLLMEngine is AsyncLLM\n"
        "assert set(pagedlm.__all__) >= {'AsyncEngineArgs', 'TokensPrompt', 'LLMEngine'}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_typed_prompts_are_the_dicts_the_engine_reads(tiny_checkpoint):
    from pagedlm import LLMEngine, SamplingParams, TokensPrompt
    from pagedlm.engine.arg_utils import EngineArgs

    engine = LLMEngine.from_engine_args(
        EngineArgs(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, num_kv_blocks=8,
                   max_model_len=64)
    )  # fmt: skip
    prompt = TokensPrompt(prompt_token_ids=[1, 2, 3], cache_salt="a")
    engine.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].prompt_token_ids == [1, 2, 3] and len(outputs[-1].outputs[0].token_ids) == 2
