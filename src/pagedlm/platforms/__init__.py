"""The Platform interface; concrete platforms live in hardware packages (pagedlm_cpu, ...)."""

from pagedlm.platforms.interface import Platform

__all__ = ["Platform"]
