"""Model implementations, looked up by HF architecture name through the registry."""

from pagedlm.model_executor.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

__all__ = ["SUPPORTED_ARCHITECTURES", "get_model_class"]
