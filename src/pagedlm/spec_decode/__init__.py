"""Speculative decoding on the workers: proposers behind one interface (``proposer.py``).

``build_proposer`` makes the proposer of a ``SpeculativeConfig``: prompt lookup
(``ngram.py``), a draft model (``draft_model.py``), EAGLE-1/EAGLE-3 heads (``eagle.py``),
DeepSeek's multi-token-prediction layer (``mtp.py``), or the benchmarks' known-acceptance
proposer (``acceptance.py``). The scheduler side is
``pagedlm.core.speculation``; verification is ``pagedlm.sample.rejection_sampler``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedlm.config import ModelConfig, SpeculativeConfig
    from pagedlm.spec_decode.model_drafter import TargetParts
    from pagedlm.spec_decode.proposer import Proposer
    from pagedlm.worker.input_batch import InputBatch


def after_update_from_disk(
    config: SpeculativeConfig | None, previous: ModelConfig, updated: ModelConfig
) -> SpeculativeConfig | None:
    """``config`` once a weight update from disk moves the target's checkpoint from
    ``previous`` to ``updated`` (only "mtp", whose layer is read from the target's
    checkpoint, may change: ``mtp.after_update_from_disk``)."""
    if config is None or config.method != "mtp":
        return config
    from pagedlm.spec_decode import mtp

    return mtp.after_update_from_disk(config, previous, updated)


def build_proposer(
    config: SpeculativeConfig, batch: InputBatch, target: TargetParts, target_model: ModelConfig
) -> Proposer:
    """The proposer ``config.method`` names (its modules imported on first use).
    ``target_model``: the target's current configuration ("mtp" reads its layer from the
    target's checkpoint, the one weight updates last loaded, unless ``draft_model`` names
    an earlier one: ``mtp.after_update_from_disk``)."""
    vocab_size = target_model.arch.vocab_size
    method = config.method
    if method == "ngram":
        from pagedlm.spec_decode.ngram import NgramProposer

        return NgramProposer(batch, config.prompt_lookup_min, config.prompt_lookup_max)
    if method == "acceptance":
        from pagedlm.spec_decode.acceptance import AcceptanceProposer

        assert config.reference_path is not None and config.acceptance_rate is not None
        return AcceptanceProposer(batch, config.reference_path, config.acceptance_rate, vocab_size)
    if method == "mtp":
        from pagedlm.spec_decode.mtp import MTPProposer, mtp_config

        return MTPProposer(batch, target, config.draft_model or mtp_config(target_model))
    assert config.draft_model is not None, f"method {method!r} needs a draft model"
    if method == "draft_model":
        from pagedlm.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(batch, target, config.draft_model)
    from pagedlm.spec_decode.eagle import EagleProposer

    return EagleProposer(batch, target, method, config.draft_model)
