"""``LLM``'s progress bar: ``use_tqdm`` may be the callable that makes it (vLLM's), and its
postfix reports the input and output speeds."""

from __future__ import annotations

from typing import ClassVar

from tqdm import tqdm

from pagedlm import LLM, SamplingParams


class RecordingBar(tqdm):
    made: ClassVar[list[RecordingBar]] = []

    def __init__(self, *args, **kwargs) -> None:
        kwargs["disable"] = False
        super().__init__(*args, **kwargs)
        self.postfixes: list[str] = []
        RecordingBar.made.append(self)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfixes.append(s)
        super().set_postfix_str(s, refresh)


def test_use_tqdm_callable_makes_the_bar(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, num_kv_blocks=16)
    try:
        prompts = [{"prompt_token_ids": list(range(5, 15))}] * 3
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=RecordingBar)
    finally:
        llm.llm_engine.shutdown()
    (bar,) = RecordingBar.made
    assert bar.total == 3 and bar.n == 3
    assert bar.postfixes and bar.postfixes[-1].startswith("est. speed input: ")
    assert "output: " in bar.postfixes[-1]
