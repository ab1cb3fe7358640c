"""Free-running greedy agreement between pagedlm and transformers, on any device.

Random-weight models have near-ties in almost every logit row, so two correct bf16
implementations pick different tokens within a few steps and then continue from different
prefixes. A *trained* model has large top-1 margins instead, so free-running agreement
measures the engine, not bf16 rounding. ``train_periodic_model`` trains a tiny Llama or
Qwen3 in seconds on a task that needs attention over the context:

    Every sequence repeats a segment of ``p`` distinct tokens, ``p`` one of a few periods
    (3, 5 or 8). Each period draws its tokens from its own residue class of the vocabulary,
    so any token of the prompt says the period, and token ``t + 1`` equals token
    ``t + 1 - p``: the model must attend ``p - 1`` positions back, a distance set by the
    content. Any prompt of length ``>= p`` fixes the whole continuation.

Everything here runs on CUDA or CPU (``DEVICE``) so the harness can be checked on CPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW_TOKENS = 32
MIXED_LENGTHS = tuple(round(5 * 60 ** (i / 31)) for i in range(32))
"""32 prompt lengths spread geometrically over 5..300 (many 16-token blocks apart)."""


@dataclass(frozen=True)
class PeriodicTask:
    """The synthetic task (see the module docstring)."""

    vocab_size: int = 512
    periods: tuple[int, ...] = (3, 5, 8)

    def pool(self, period: int) -> torch.Tensor:
        """Token ids a period-``period`` sequence draws from: one residue class per period."""
        return torch.arange(self.periods.index(period), self.vocab_size, len(self.periods))

    def period_of(self, token: int) -> int:
        """The period of any sequence containing ``token``."""
        return self.periods[token % len(self.periods)]

    def sequence(self, period: int, length: int, gen: torch.Generator) -> torch.Tensor:
        """[length] token ids: a random segment of ``period`` distinct tokens, repeated."""
        pool = self.pool(period)
        segment = pool[torch.randperm(len(pool), generator=gen)[:period]]
        return segment.repeat(length // period + 1)[:length]

    def _random_period(self, gen: torch.Generator, longest: int) -> int:
        choices = [p for p in self.periods if p <= longest]
        return choices[int(torch.randint(len(choices), (1,), generator=gen))]

    def batch(
        self, batch_size: int, length: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [batch, length] and a bool mask [batch, length - 1] of the targets the
        prefix determines (target ``j + 1`` with ``j + 1 >= period``)."""
        ids = torch.empty(batch_size, length, dtype=torch.long)
        mask = torch.zeros(batch_size, length - 1, dtype=torch.bool)
        for row in range(batch_size):
            period = self._random_period(gen, length)
            ids[row] = self.sequence(period, length, gen)
            mask[row, period - 1 :] = True
        return ids, mask

    def prompts(self, lengths=MIXED_LENGTHS, seed: int = 0) -> list[list[int]]:
        """One prompt per length, each with a period no longer than the prompt (so the
        prompt fixes its continuation)."""
        gen = torch.Generator().manual_seed(seed)
        return [self.sequence(self._random_period(gen, n), n, gen).tolist() for n in lengths]

    def continuation(self, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
        """The task's answer: the prompt's period continued."""
        period = self.period_of(prompt[0])
        full = list(prompt)
        for _ in range(new_tokens):
            full.append(full[-period])
        return full[len(prompt) :]


def tiny_config(arch: str, task: PeriodicTask):
    """A 2-layer, hidden-128 Llama (head_dim 32) or Qwen3 (head_dim 64) config, tied
    embeddings as in Qwen3-0.6B."""
    import transformers

    common = dict(
        vocab_size=task.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        # Tying makes the copy circuit (embedding -> value -> unembedding) easy to learn.
        tie_word_embeddings=True,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen3":
        # q/k RMSNorm bounds an attention logit by sqrt(head_dim) until the norms' gains
        # grow; at head_dim 32 that was too flat to pick one position out of ~350 within
        # the training budget (some seeds stalled at loss ~0.1), at 64 every seed converged.
        return transformers.Qwen3Config(head_dim=64, **common)
    raise ValueError(f"unknown arch {arch!r}; use 'llama' or 'qwen3'")


@dataclass(frozen=True)
class TrainReport:
    """How well training went, measured in float32 on fresh sequences of 64 and 352 tokens."""

    final_loss: float
    eval_loss: float
    eval_accuracy: float
    seconds: float


# (length, batch) pairs cycled through training: ~1.5k tokens a step, up to 352 tokens so
# that the 300-token prompts plus 32 new tokens stay inside the trained context.
_SCHEDULE = ((32, 48), (64, 24), (128, 12), (352, 4))


def _masked_loss(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    logits = model(ids).logits[:, :-1].float()
    target = ids[:, 1:]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    loss = losses[mask].mean()
    accuracy = (logits.argmax(-1) == target)[mask].float().mean().item()
    return loss, accuracy


def train_periodic_model(
    arch: str,
    path: Path,
    task: PeriodicTask = PeriodicTask(),
    steps: int = 1000,
    lr: float = 3e-3,
    device: str = DEVICE,
    seed: int = 0,
) -> TrainReport:
    """Train a tiny ``arch`` model on ``task`` with AdamW (one-cycle schedule, gradients
    clipped at norm 1) in float32 on ``device`` and ``save_pretrained`` it (float32) to
    ``path``. 1-1.5 min on one CPU core; ~10 s on a GPU (estimated, ~10 ms a step)."""
    threads = torch.get_num_threads()
    if device == "cpu":
        # Tensors this small train fastest on one thread (5x faster than two on a busy
        # 2-core machine, measured).
        torch.set_num_threads(1)
    try:
        return _train(arch, path, task, steps, lr, device, seed)
    finally:
        torch.set_num_threads(threads)


def _train(
    arch: str, path: Path, task: PeriodicTask, steps: int, lr: float, device: str, seed: int
) -> TrainReport:
    import time

    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(arch, task), dtype=torch.float32
    ).to(device)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    start = time.perf_counter()
    losses = []
    for step in range(steps):
        length, batch_size = _SCHEDULE[step % len(_SCHEDULE)]
        ids, mask = task.batch(batch_size, length, gen)
        loss, _ = _masked_loss(model, ids.to(device), mask.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # Clipping tames the loss spikes that otherwise leave some seeds short of converged.
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    model.eval()
    eval_gen = torch.Generator().manual_seed(seed + 1)
    eval_losses, accuracies = [], []
    with torch.no_grad():
        for length, batch_size in ((64, 32), (352, 16)):
            ids, mask = task.batch(batch_size, length, eval_gen)
            loss, accuracy = _masked_loss(model, ids.to(device), mask.to(device))
            eval_losses.append(loss.item())
            accuracies.append(accuracy)
    model.save_pretrained(path)
    return TrainReport(
        final_loss=sum(losses[-len(_SCHEDULE) * 5 :]) / (len(_SCHEDULE) * 5),
        eval_loss=max(eval_losses),
        eval_accuracy=min(accuracies),
        seconds=seconds,
    )


def random_prompts(vocab_size: int, lengths=MIXED_LENGTHS, seed: int = 0) -> list[list[int]]:
    """Uniformly random token ids, one prompt per length."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def hf_greedy(
    path,
    prompts: list[list[int]],
    dtype: torch.dtype,
    attn_implementation: str = "sdpa",
    device: str = DEVICE,
    new_tokens: int = NEW_TOKENS,
    batched: bool = False,
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt: one prompt at a time (no padding),
    or all at once left-padded (``batched``; positions follow the attention mask)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation
    ).to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    greedy = dict(max_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        if batched:
            longest = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), longest, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, prompt in enumerate(prompts):
                ids[row, longest - len(prompt) :] = torch.tensor(prompt)
                mask[row, longest - len(prompt) :] = 1
            generated = model.generate(ids.to(device), attention_mask=mask.to(device), **greedy)
            outs = generated[:, longest:].tolist()
        else:
            outs = []
            for prompt in prompts:
                ids = torch.tensor([prompt], device=device)
                # An all-ones mask: token 0 is data, not padding.
                generated = model.generate(ids, attention_mask=torch.ones_like(ids), **greedy)
                outs.append(generated[0, len(prompt) :].tolist())
    del model
    _free_device_memory(device)
    return outs


def pagedlm_greedy(
    path,
    prompts: list[list[int]],
    dtype: str,
    platform: str | None = None,
    new_tokens: int = NEW_TOKENS,
    **engine_args,
) -> list[list[int]]:
    """pagedlm's greedy continuation of all prompts, submitted as one batch."""
    from pagedlm import LLM, SamplingParams

    llm = LLM(
        str(path),
        dtype=dtype,
        platform=platform,
        skip_tokenizer_init=True,
        max_model_len=1024,
        **engine_args,
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    _free_device_memory(DEVICE if platform is None else platform)
    return [list(o.outputs[0].token_ids) for o in outs]


def _free_device_memory(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def per_sequence_agreement(a: list[list[int]], b: list[list[int]]) -> list[float]:
    """For each row, the fraction of ``b``'s positions matched by ``a`` before the first
    mismatch (after it the two continue from different prefixes, so the rest counts as
    mismatched)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} rows against {len(b)}")
    fractions = []
    for x, y in zip(a, b):
        same = 0
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
        fractions.append(same / len(y))
    return fractions


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Agreeing positions over all positions of ``b`` (rows are equally long)."""
    fractions = per_sequence_agreement(a, b)
    return sum(fractions) / len(fractions)


def standard_error(fractions: list[float]) -> float:
    """Standard error of the mean of per-sequence agreements."""
    n = len(fractions)
    mean = sum(fractions) / n
    return (sum((f - mean) ** 2 for f in fractions) / (n - 1) / n) ** 0.5
