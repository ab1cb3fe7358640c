"""Checks of a platform against ``pagedlm.platforms.interface.Platform`` and of the fused
sampler it may hand to the sampler (``pagedlm.sample.sampler.FusedRandomSampler``)."""

from __future__ import annotations

import torch

from pagedlm.kv_cache.interface import kv_bytes_per_block
from pagedlm.platforms import Platform
from pagedlm.plugins import registry
from pagedlm.plugins.specs import import_target
from pagedlm.sample.sampler import FusedRandomSampler
from pagedlm.testing.promises import ConformanceFailure, NotApplicable

_PROBE_DTYPES = (torch.float64, torch.float16, torch.bfloat16, torch.float32)


def _subject(platform: Platform) -> str:
    return f"platform {platform.name!r}"


def check_platform_identity(platform: Platform, pm: registry.PluginManager | None = None) -> None:
    """Its registered name, a valid device, and defaults that the registry resolves."""

    def fail(detail: str) -> ConformanceFailure:
        return ConformanceFailure(_subject(platform), "platform_identity", detail)

    specs = registry.registered_platforms(pm)
    if platform.name not in specs:
        raise fail(f"no registered PlatformSpec is named {platform.name!r}: {sorted(specs)}")
    if platform.device.type != platform.device_type:
        raise fail(f"device {platform.device} is not of device_type {platform.device_type!r}")
    dtypes = platform.supported_dtypes
    if not dtypes or not all(isinstance(d, torch.dtype) for d in dtypes):
        raise fail(f"supported_dtypes must be a non-empty tuple of torch dtypes, got {dtypes!r}")
    if platform.default_dtype(None) not in dtypes:
        raise fail(f"default_dtype(None) = {platform.default_dtype(None)} is not supported")
    for spec in registry.attention_backends_for(platform, pm):
        backend_cls = import_target(spec.target)
        if getattr(backend_cls, "name", None) != spec.name:
            raise fail(
                f"BackendSpec {spec.name!r} names a class whose name is {backend_cls.name!r}"
            )
    try:
        backend_cls = registry.select_attention_backend(platform, pm=pm)
        executor_cls = registry.select_executor(platform, pm=pm)
    except registry.PluginError as exc:
        raise fail(str(exc)) from exc
    if backend_cls.name != platform.default_attention_backend:
        raise fail(f"default_attention_backend resolves to {backend_cls.name!r}")
    if executor_cls.name != platform.default_executor:
        raise ConformanceFailure(
            _subject(platform),
            "executor_choice",
            f"default_executor {platform.default_executor!r} resolves to {executor_cls.name!r}",
        )


def check_dtypes(platform: Platform) -> None:
    supported = platform.supported_dtypes
    names = [str(d).removeprefix("torch.") for d in supported]
    for dtype in supported:
        try:
            platform.check_dtype(dtype)
        except ValueError as exc:
            raise ConformanceFailure(
                _subject(platform),
                "dtype",
                f"check_dtype({dtype}) refused a supported dtype: {exc}",
            ) from exc
    unsupported = next((d for d in _PROBE_DTYPES if d not in supported), None)
    if unsupported is None:
        return
    try:
        platform.check_dtype(unsupported)
    except ValueError as exc:
        if not any(name in str(exc) for name in names):
            raise ConformanceFailure(
                _subject(platform), "dtype", f"the error names no supported dtype: {exc}"
            ) from exc
        return
    raise ConformanceFailure(
        _subject(platform), "dtype", f"check_dtype({unsupported}) accepted an unsupported dtype"
    )


def check_zeros(platform: Platform) -> None:
    for dtype in platform.supported_dtypes:
        tensor = platform.zeros((3, 5), dtype)
        got = (tuple(tensor.shape), tensor.dtype, tensor.device.type)
        expected = ((3, 5), dtype, platform.device_type)
        if got != expected or bool(tensor.any()):
            raise ConformanceFailure(
                _subject(platform),
                "zeros",
                f"zeros((3, 5), {dtype}) gave {got} (expected {expected}) "
                f"{'with non-zero values' if got == expected else ''}",
            )


def check_memory_sizing(platform: Platform) -> None:
    """An unbound platform (no engine config) gives an int budget for a tiny model's
    blocks, and without ``bytes_per_block`` too."""
    per_block = kv_bytes_per_block(16, 2, 2, 64, platform.supported_dtypes[0])
    for argument in (per_block, None):
        budget = platform.kv_cache_memory_bytes(argument)
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ConformanceFailure(
                _subject(platform),
                "memory_sizing",
                f"kv_cache_memory_bytes({argument}) returned {budget!r}",
            )


def check_platform_sampler(platform: Platform) -> None:
    sampler = platform.fused_sampler()
    if sampler is None:
        raise NotApplicable(f"{_subject(platform)} hands the sampler no fused kernel")
    check_fused_sampler(sampler, platform.device, _subject(platform))


def check_fused_sampler(
    sampler: FusedRandomSampler,
    device: torch.device,
    subject: str = "fused sampler",
    rows_per_temperature: int = 4096,
) -> None:
    """Greedy rows (all, or those of ``noise_scale`` 0) get ``torch.argmax``'s token, first
    index among ties; the other rows draw from ``softmax(logits / temperature)`` (token
    frequencies within six standard errors, at two temperatures); logits are not written.
    """

    def fail(detail: str) -> ConformanceFailure:
        return ConformanceFailure(subject, "fused_sampler", detail)

    generator = torch.Generator().manual_seed(0)
    greedy = torch.randn(5, 1000, generator=generator)
    greedy[3, 7] = greedy[3, 900] = greedy[3].max() + 1  # a tie: torch.argmax says 7
    greedy = greedy.to(device)
    ids = sampler(greedy.clone(), None, None, None)
    if ids.dtype != torch.int64 or tuple(ids.shape) != (5,) or ids.device.type != device.type:
        raise fail(f"greedy call returned {ids.dtype} {tuple(ids.shape)} on {ids.device}")
    if not torch.equal(ids.cpu(), greedy.argmax(dim=-1).cpu()):
        raise fail(f"greedy rows gave {ids.tolist()}, argmax is {greedy.argmax(-1).tolist()}")

    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.25, 1.5])
    temperatures = (1.0, 0.5)
    rows = [base.expand(rows_per_temperature, -1) for _ in temperatures]
    logits = torch.cat([*rows, greedy[:, : base.numel()].cpu()]).contiguous().to(device)
    temperature = torch.tensor(
        [t for t in temperatures for _ in range(rows_per_temperature)] + [1.0] * 5
    )
    noise_scale = torch.ones_like(temperature)
    noise_scale[-5:] = 0.0
    before = logits.clone()
    seed = torch.tensor([1234], dtype=torch.int64, device=device)
    ids = sampler(logits, temperature.to(device), noise_scale.to(device), seed).cpu()
    if not torch.equal(logits, before):
        raise fail("it wrote into the caller's logits")
    expected_greedy = before[-5:].argmax(dim=-1).cpu()
    if not torch.equal(ids[-5:], expected_greedy):
        raise fail(f"rows with noise_scale 0 gave {ids[-5:].tolist()}, argmax {expected_greedy}")
    for group, temp in enumerate(temperatures):
        drawn = ids[group * rows_per_temperature : (group + 1) * rows_per_temperature]
        frequency = torch.bincount(drawn, minlength=base.numel()).double() / rows_per_temperature
        probs = (base.double() / temp).softmax(-1)
        bound = 6 * (probs * (1 - probs) / rows_per_temperature).sqrt() + 1e-3
        if ((frequency - probs).abs() > bound).any():
            raise fail(
                f"at temperature {temp}, token frequencies {frequency.numpy().round(3)} are not "
                f"softmax(logits / temperature) = {probs.numpy().round(3)}"
            )
