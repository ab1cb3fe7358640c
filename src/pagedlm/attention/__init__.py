"""Attention backends: the interface and the per-step metadata they consume."""

from pagedlm.attention.backend import AttentionBackend, AttentionMetadata, BatchLayout

__all__ = ["AttentionBackend", "AttentionMetadata", "BatchLayout"]
