"""``--worker-extension-cls`` (vLLM's): a class whose methods join every worker's, so that
``collective_rpc("method", ...)`` can call them (an RL trainer's weight sync, for one).

The class is named by import path ('package.module:Class' or 'package.module.Class') and
imported in every process that builds a worker. The engine checks it at start-up
(``load_worker_extension``): importable, a class, and no attribute besides dunders that
the worker has too, since a mixed-in name would hide the worker's own or be hidden by it
(vLLM asserts the same). Each worker is then an instance of ``Worker`` subclassed with the
extension (``worker_class``), so the extension's methods run with ``self`` the worker: its
``rank``, ``device``, ``model_runner`` and ``get_model()``. The extension's ``__init__`` is
not called (the worker's is); it keeps its state in attributes it sets when first called.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedlm.qualified_names import import_object
from pagedlm.worker.worker import RankPlacement, Worker

if TYPE_CHECKING:
    from pagedlm.attention import AttentionBackend
    from pagedlm.config import EngineConfig
    from pagedlm.platforms import Platform

FLAG = "--worker-extension-cls"


def load_worker_extension(name: str) -> type:
    """The extension class ``name`` points at, checked; ValueError naming the flag."""
    extension = import_object(name, FLAG)
    if not isinstance(extension, type):
        raise ValueError(
            f"{FLAG} {name!r} is a {type(extension).__name__}, not a class; name a class "
            "whose methods take the worker as self."
        )
    _check_clashes(name, extension, dir(Worker))
    return extension


def _check_clashes(name: str, extension: type, worker_names: Iterable[str]) -> None:
    own = {attribute for attribute in dir(extension) if not attribute.startswith("__")}
    clashes = sorted(own.intersection(worker_names))
    if clashes:
        raise ValueError(
            f"{FLAG} {name!r}: {', '.join(map(repr, clashes))} "
            f"{'is' if len(clashes) == 1 else 'are'} the worker's own; rename "
            f"{'it' if len(clashes) == 1 else 'them'} in the extension class."
        )


@functools.cache
def worker_class(extension_name: str | None) -> type[Worker]:
    """``Worker``, or ``Worker`` with the extension mixed in."""
    if not extension_name:
        return Worker
    extension = load_worker_extension(extension_name)
    try:
        return type(f"{extension.__name__}Worker", (Worker, extension), {"__module__": __name__})
    except TypeError as error:  # a metaclass or layout the worker cannot share
        raise ValueError(
            f"{FLAG} {extension_name!r} cannot be mixed into the worker: {error}"
        ) from None


def make_worker(
    config: EngineConfig,
    platform: Platform,
    attn_backend_cls: type[AttentionBackend],
    placement: RankPlacement | None = None,
) -> Worker:
    """A worker of ``config``'s class (see ``worker_class``)."""
    name = config.parallel.worker_extension_cls
    worker = worker_class(name)(config, platform, attn_backend_cls, placement)
    if name:
        # The worker's instance attributes, which a method of the same name would lose to.
        _check_clashes(name, load_worker_extension(name), vars(worker))
    return worker
