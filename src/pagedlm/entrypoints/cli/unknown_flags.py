"""What an unrecognized flag should have been: vLLM's flags that pagedlm does not take,
each with what to do instead, and the nearest of the subcommand's own flags for a typo.

Argparse alone says only "unrecognized arguments: --swap-space 4"; a command line written
for vLLM deserves the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

_REMOVED_IN_VLLM_V1 = "removed in vLLM's V1 engine, which pagedlm follows; drop it"
VLLM_FLAGS_NOT_TAKEN = {
    "--swap-space": "a preempted request is recomputed, never swapped to host memory; drop "
    "it (--kv-offloading-size GiB keeps computed blocks in host memory)",
    "--preemption-mode": "preemption always recomputes; drop it",
    "--num-scheduler-steps": _REMOVED_IN_VLLM_V1,
    "--multi-step-stream-outputs": _REMOVED_IN_VLLM_V1,
    "--use-v2-block-manager": _REMOVED_IN_VLLM_V1,
    "--disable-async-output-proc": _REMOVED_IN_VLLM_V1,
    "--scheduler-delay-factor": _REMOVED_IN_VLLM_V1,
    "--num-lookahead-slots": _REMOVED_IN_VLLM_V1,
    "--max-seq-len-to-capture": _REMOVED_IN_VLLM_V1 + " (graph sizes: -cc "
    "'{\"max_cudagraph_capture_size\": N}')",
    "--cuda-graph-sizes": "use -cc '{\"cudagraph_capture_sizes\": [1, 2, 4]}'",
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
    "--guided-decoding-backend": "use --structured-outputs-config '{\"backend\": ...}'",
    "--enable-reasoning": "--reasoning-parser NAME alone turns reasoning on; drop it",
    "--rope-scaling": "use --hf-overrides '{\"rope_scaling\": {...}}'",
    "--rope-theta": "use --hf-overrides '{\"rope_theta\": ...}'",
    "--task": "use --runner generate or --runner pooling",
    "--device": "the platform is chosen by its plugin; set PAGEDLM_PLATFORM=cpu (or cuda, "
    "rocm) to choose one",
    "--disable-frontend-multiprocessing": "the engine core always runs in its own process "
    "behind the server; drop it",
    "--api-server-count": "one API server process serves the engine; drop it (or start "
    "several servers behind a load balancer)",
    "--headless": "pagedlm has no headless data-parallel nodes; drop it",
    "--lora-dtype": "adapters take the model's dtype; drop it",
    "--lora-extra-vocab-size": "removed in vLLM; adapters cannot add tokens; drop it",
    "--long-lora-scaling-factors": "removed in vLLM; drop it",
    "--fully-sharded-loras": "adapters are not sharded across tensor-parallel ranks; drop it",
    "--disable-mm-preprocessor-cache": "there is no preprocessor cache to turn off; drop it",
    "--mm-processor-cache-gb": "there is no preprocessor cache to size; drop it",
    "--disable-custom-all-reduce": "pagedlm reduces with torch.distributed only; drop it",
}
"""vLLM's flags that pagedlm's parser does not take, and what to do instead."""


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
