"""Connector names -> classes: the built-in registry (vLLM's names where the behaviour is
vLLM's), or a class from ``kv_connector_module_path``; imported only when named."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedlm.kv_transfer.base import KVConnectorBase, KVConnectorRole
from pagedlm.qualified_names import import_object

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig, KVTransferConfig

CONNECTORS: dict[str, str] = {
    "ExampleConnector": "pagedlm.kv_transfer.shared_storage:SharedStorageConnector",
    "SharedStorageConnector": "pagedlm.kv_transfer.shared_storage:SharedStorageConnector",
    "OffloadingConnector": "pagedlm.kv_transfer.offloading:OffloadingConnector",
}
"""Built-in connectors (``SharedStorageConnector`` is vLLM's former name of
``ExampleConnector``; ``OffloadingConnector`` is what ``kv_offloading_size`` builds)."""


def connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    """The class ``config`` names; ValueError listing the known names otherwise."""
    name = config.kv_connector
    assert name is not None
    if config.kv_connector_module_path is not None:
        target = f"{config.kv_connector_module_path}:{name}"
        cls = import_object(target, "kv_connector_module_path")
    elif name in CONNECTORS:
        cls = import_object(CONNECTORS[name], "kv_connector")
    else:
        raise ValueError(
            f"Unknown kv_connector {name!r}; known: {sorted(CONNECTORS)}, or name a class "
            "and give its module as kv_connector_module_path."
        )
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(
            f"kv_connector {name!r} is not a subclass of "
            "pagedlm.kv_transfer.KVConnectorBase (vLLM's KVConnectorBase_V1)."
        )
    return cls


def make_connector(config: EngineConfig, role: KVConnectorRole) -> KVConnectorBase | None:
    """The connector ``config.kv_transfer`` names, built for ``role``; None when off."""
    if config.kv_transfer is None:
        return None
    return connector_class(config.kv_transfer)(config, role)


def check_weight_update(config: EngineConfig) -> None:
    """ValueError, naming the fix, when the configured connector cannot go on after the
    weights are replaced (``KVConnectorBase.supports_weight_updates``)."""
    transfer = config.kv_transfer
    if transfer is None or connector_class(transfer).supports_weight_updates:
        return
    raise ValueError(
        f"Cannot update the weights with kv_connector {transfer.kv_connector!r}: its stored "
        "KV is named for the weights the engine started with, which other engines may still "
        "use, so the new weights' KV would be stored and loaded as theirs. Start an engine on "
        "the new checkpoint instead (its KV gets a storage directory of its own), or run "
        "without kv_transfer_config."
    )
