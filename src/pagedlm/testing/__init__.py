"""The conformance kit: checks a platform and its attention backends against the plugin
contract (``docs/plugins.md``), as pytest tests or as plain functions.

Run it for an installed platform::

    PAGEDLM_PLATFORM=<name> python -m pytest --pyargs pagedlm.testing

or call the checks from a plugin's own tests::

    from pagedlm.testing import BACKEND_CHECKS, AttentionTarget

    for check in BACKEND_CHECKS.values():
        check(AttentionTarget(MyBackend, torch.device("cpu"), block_sizes=(128,)))

Every check raises ``ConformanceFailure`` (an ``AssertionError``) naming the broken
promise, or ``NotApplicable`` when the target does not offer what it checks.
"""

from pagedlm.testing.parity import TINY_MODELS, check_greedy_parity, tiny_checkpoint
from pagedlm.testing.platform_checks import (
    check_argmax_rows,
    check_fused_sampler,
    check_greedy_verifier,
    check_in_flight_corrector,
    check_step_gatherer,
)
from pagedlm.testing.promises import PROMISES, ConformanceFailure, NotApplicable, Promise
from pagedlm.testing.reference import reference_attention
from pagedlm.testing.suite import BACKEND_CHECKS, PLATFORM_CHECKS, backend_targets
from pagedlm.testing.target import AttentionTarget, HeadShape

__all__ = [
    "BACKEND_CHECKS",
    "PLATFORM_CHECKS",
    "PROMISES",
    "TINY_MODELS",
    "AttentionTarget",
    "ConformanceFailure",
    "HeadShape",
    "NotApplicable",
    "Promise",
    "backend_targets",
    "check_argmax_rows",
    "check_fused_sampler",
    "check_greedy_parity",
    "check_greedy_verifier",
    "check_in_flight_corrector",
    "check_step_gatherer",
    "reference_attention",
    "tiny_checkpoint",
]
