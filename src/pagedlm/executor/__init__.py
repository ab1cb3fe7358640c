"""Executors run the model for a SchedulerOutput, on one or more workers."""

from pagedlm.executor.interface import Executor

__all__ = ["Executor"]
