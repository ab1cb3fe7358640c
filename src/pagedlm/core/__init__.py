"""The engine core: requests, scheduler, and the step loop that drives the executor."""
