"""What an unrecognized flag should have been: vLLM's flags that pagedlm does not take,
each with what to do instead, and the nearest of the subcommand's own flags for a typo.

Argparse alone says only "unrecognized arguments: --num-scheduler-steps 8"; a command line
written for vLLM deserves the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

_REMOVED_IN_VLLM_V1 = "removed in vLLM's V1 engine, which pagedlm follows; drop it"
_REMOVED_EPLB = "removed in vLLM (now --eplb-config); pagedlm has no expert-parallel load balancer"
VLLM_FLAGS_NOT_TAKEN = {
    "--preemption-mode": "preemption always recomputes; drop it",
    "--num-scheduler-steps": _REMOVED_IN_VLLM_V1,
    "--multi-step-stream-outputs": _REMOVED_IN_VLLM_V1,
    "--use-v2-block-manager": _REMOVED_IN_VLLM_V1,
    "--disable-async-output-proc": _REMOVED_IN_VLLM_V1,
    "--scheduler-delay-factor": _REMOVED_IN_VLLM_V1,
    "--num-lookahead-slots": _REMOVED_IN_VLLM_V1,
    "--max-seq-len-to-capture": _REMOVED_IN_VLLM_V1 + " (graph sizes: -cc "
    "'{\"max_cudagraph_capture_size\": N}')",
    "--tokenizer-pool-size": _REMOVED_IN_VLLM_V1,
    "--enable-prompt-adapter": _REMOVED_IN_VLLM_V1,
    "--prompt-adapters": _REMOVED_IN_VLLM_V1,
    "--max-prompt-adapters": _REMOVED_IN_VLLM_V1,
    "--worker-use-ray": "use --distributed-executor-backend ray",
    "--speculative-model": 'use --speculative-config \'{"model": ..., '
    '"num_speculative_tokens": N}\'',
    "--num-speculative-tokens": 'use --speculative-config \'{"method": ..., '
    '"num_speculative_tokens": N}\'',
    "--ngram-prompt-lookup-max": 'use --speculative-config \'{"method": "ngram", '
    '"prompt_lookup_max": N, "num_speculative_tokens": K}\'',
    "--enable-reasoning": "--reasoning-parser NAME alone turns reasoning on; drop it",
    "--device": "the platform is chosen by its plugin; set PAGEDLM_PLATFORM=cpu (or cuda, "
    "rocm) to choose one",
    "--long-lora-scaling-factors": "removed in vLLM; drop it",
    "--enable-multimodal-encoder-data-parallel": "removed in vLLM (its --mm-encoder-tp-mode "
    "data, which pagedlm does not have); drop it",
    "--num-redundant-experts": _REMOVED_EPLB,
    "--eplb-window-size": _REMOVED_EPLB,
    "--eplb-step-interval": _REMOVED_EPLB,
    "--eplb-log-balancedness": _REMOVED_EPLB,
}
"""vLLM's flags, removed from vLLM itself, that pagedlm's parser does not take either, and
what to do instead. vLLM's current flags are all taken (``pagedlm.engine.vllm_compat_args``,
``pagedlm.entrypoints.openai.vllm_server_args``)."""


def unknown_flags_message(extras: list[str], known: Iterable[str]) -> str:
    """argparse's "unrecognized arguments: ..." with, for each unknown flag, vLLM's fix or
    the nearest of ``known`` (the subcommand's flags)."""
    known = sorted(set(known))
    hints = []
    for arg in extras:
        if not arg.startswith("--"):
            continue
        flag = arg.partition("=")[0]
        if flag in VLLM_FLAGS_NOT_TAKEN:
            hints.append(f"{flag} is vLLM's, which pagedlm does not take: "
                         f"{VLLM_FLAGS_NOT_TAKEN[flag]}.")  # fmt: skip
            continue
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.8)
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(extras)}"
    return "\n".join([message, *hints])
