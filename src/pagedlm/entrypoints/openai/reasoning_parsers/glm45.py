"""GLM-4.5 / GLM-4.6 reasoning: ``<think>...</think>`` like Qwen3.

The model writes ``<think>`` itself when it thinks; with thinking off its chat template puts
an empty ``<think></think>`` in the prompt and the output is all answer. A template that ends
the prompt with ``<think>`` opened the thought, and the output starts inside it (as llama.cpp's
GLM-4.5 handler has it: ``thinking_forced_open``). Unlike vLLM's
whole-text path (which calls an unclosed thought content), an output cut off inside its
thought is reasoning here, as vLLM's streaming path has it: one answer for both.
"""

from __future__ import annotations

from pagedlm.entrypoints.openai.reasoning_parsers.think import Qwen3ReasoningParser


class Glm45ReasoningParser(Qwen3ReasoningParser):
    pass
