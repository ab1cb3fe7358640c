"""KV transfer (vLLM's ``kv_transfer_config``): connectors that save prompts' KV for other
engines and load theirs instead of computing it (``base.py`` has the protocol)."""

from pagedlm.kv_transfer.base import KVConnectorBase, KVConnectorBase_V1, KVConnectorRole

__all__ = ["KVConnectorBase", "KVConnectorBase_V1", "KVConnectorRole"]
