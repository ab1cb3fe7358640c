"""The version of the plugin contract, and the check that refuses plugins built for another.

The contract is everything a plugin may rely on (``docs/plugins.md`` lists it): the hooks
of ``hookspecs.py``, the specs of ``specs.py``, and the interfaces with their stated
invariants (``Platform``, ``GraphRunner``, ``AttentionBackend`` with ``BatchLayout``,
``KVCache``, ``Executor`` with ``Worker``, the step protocol, ``FusedRandomSampler``).

Its version is ``MAJOR.MINOR``. A change that can break a plugin written for the current
contract (a hook or argument removed or renamed, an invariant a plugin relied on
loosened, a new abstract method) raises MAJOR; an addition that old plugins may ignore (a
new optional hook, a new capability flag with a default) raises MINOR.

A plugin declares the version it was built and tested against as a literal in the module
it registers::

    PAGEDLM_CONTRACT_VERSION = "1.0"

(never by importing ``CONTRACT_VERSION``, which would make the check pass for any core).
It is accepted when its MAJOR equals core's and its MINOR is not newer than core's.
"""

from __future__ import annotations

import re

CONTRACT_VERSION = "1.0"
"""The contract this pagedlm implements."""

DECLARATION = "PAGEDLM_CONTRACT_VERSION"
"""The module attribute (or plugin object attribute) naming a plugin's contract version."""

_VERSION = re.compile(r"(\d+)\.(\d+)")


def parse_version(version: str) -> tuple[int, int]:
    """``"1.0"`` -> ``(1, 0)``; ``ValueError`` for anything but ``MAJOR.MINOR``."""
    match = _VERSION.fullmatch(version) if isinstance(version, str) else None
    if match is None:
        raise ValueError(f"{version!r} is not a contract version of the form 'MAJOR.MINOR'")
    return int(match[1]), int(match[2])


def contract_refusal(plugin: object, name: str, core_version: str = CONTRACT_VERSION) -> str | None:
    """Why ``plugin`` (registered as ``name``) cannot be loaded, or None when it may be."""
    declared = getattr(plugin, DECLARATION, None)
    if declared is None:
        return (
            f"plugin {name!r} declares no contract version; once it meets contract "
            f'{core_version}, add {DECLARATION} = "{core_version}" to the module it registers '
            "(see docs/plugins.md)."
        )
    try:
        major, minor = parse_version(declared)
    except ValueError as exc:
        return f"plugin {name!r} has {DECLARATION} = {declared!r}: {exc}."
    core_major, core_minor = parse_version(core_version)
    if major != core_major:
        return (
            f"plugin {name!r} was built for plugin contract {declared}, but this pagedlm "
            f"implements contract {core_version}; install a release of the plugin built for "
            f"contract {core_major}.x, or a pagedlm that implements contract {major}.x."
        )
    if minor > core_minor:
        return (
            f"plugin {name!r} needs plugin contract {declared}, newer than contract "
            f"{core_version} of this pagedlm; upgrade pagedlm."
        )
    return None
