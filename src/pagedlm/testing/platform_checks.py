"""Checks of a platform against ``pagedlm.platforms.interface.Platform`` and of the kernels
it may put in place of torch ops: the fused sampler
(``pagedlm.sample.sampler.FusedRandomSampler``), the greedy verifier
(``pagedlm.sample.rejection_sampler.FusedGreedyVerifier``), the in-flight corrector
(``pagedlm.worker.spec_positions.InFlightCorrector``) and the step gatherer
(``pagedlm.worker.step_inputs.StepGatherer``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedlm.kv_cache.interface import kv_bytes_per_block
from pagedlm.platforms import Platform
from pagedlm.plugins import registry
from pagedlm.plugins.specs import import_target
from pagedlm.sample.metadata import SamplingMetadata
from pagedlm.sample.rejection_sampler import FusedGreedyVerifier, RejectionSampler
from pagedlm.sample.row import SamplingRow
from pagedlm.sample.sampler import FusedRandomSampler
from pagedlm.sampling_params import SamplingParams
from pagedlm.testing.promises import ConformanceFailure, NotApplicable
from pagedlm.worker.spec_positions import InFlightCorrector, correct_on_device
from pagedlm.worker.step_inputs import StepGatherer, gather_on_device

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


def check_host_mapping(platform: Platform) -> None:
    """``map_host_tensor`` gives None, or a tensor on the device with the host tensor's
    shape, dtype and values that reads later writes to the host tensor (and back)."""
    host = platform.empty_host((4, 6), torch.bfloat16)
    host.copy_(torch.arange(24, dtype=torch.bfloat16).view(4, 6))
    view = platform.map_host_tensor(host)
    if view is None:
        raise NotApplicable(f"{_subject(platform)} maps no host memory (cpu_offload_gb: none)")

    def fail(detail: str) -> ConformanceFailure:
        return ConformanceFailure(_subject(platform), "host_mapping", detail)

    got = (tuple(view.shape), view.dtype, view.device.type)
    if got != ((4, 6), torch.bfloat16, platform.device_type):
        raise fail(f"map_host_tensor gave {got} for a (4, 6) bfloat16 host tensor")
    if not torch.equal(view.cpu(), host):
        raise fail("the view's values differ from the host tensor's")
    host[1, 2] = -7.0
    view[3, 5] = 11.0  # a kernel writing through the view
    platform.synchronize()
    if float(view[1, 2].cpu()) != -7.0 or float(host[3, 5]) != 11.0:
        raise fail("a write to the host tensor or the view does not show in the other")


def _kernel_of(platform: Platform, hook: str, without: str):
    """What ``platform.<hook>()`` hands the engine; NotApplicable (``without`` says what the
    platform does instead) where it hands nothing."""
    kernel = getattr(platform, hook)()
    if kernel is None:
        raise NotApplicable(f"{_subject(platform)} {without}")
    return kernel


def check_platform_sampler(platform: Platform) -> None:
    sampler = _kernel_of(platform, "fused_sampler", "hands the sampler no fused kernel")
    check_fused_sampler(sampler, platform.device, _subject(platform))


def check_platform_argmax(platform: Platform) -> None:
    check_argmax_rows(platform.argmax_rows(), platform.device, _subject(platform))


def check_argmax_rows(
    argmax: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    subject: str = "argmax_rows",
) -> None:
    """``argmax(logits)`` is ``logits.max(dim=-1).indices``: [N] int64 on the logits'
    device, the first index among ties, a row's first NaN, 0 for a row of -inf; at short
    and vocabulary-wide rows, float32 and bfloat16; the logits are not written."""

    def fail(detail: str) -> ConformanceFailure:
        return ConformanceFailure(subject, "argmax_rows", detail)

    generator = torch.Generator().manual_seed(0)
    for vocab in (1000, 49_153):
        rows = torch.randn(6, vocab, generator=generator)
        rows[1] = 0.0  # all tied: 0
        rows[2, 9] = rows[2, vocab - 3] = float("nan")  # the first NaN
        rows[3] = float("-inf")
        rows[4, 300] = rows[4, vocab - 300] = 40.0  # tied maxima far apart: the first
        rows[5, vocab - 1] = 40.0
        for dtype in (torch.float32, torch.bfloat16):
            logits = rows.to(dtype).to(device)
            before = logits.clone()
            ids = argmax(logits)
            expected = rows.to(dtype).max(dim=-1).indices
            if ids.dtype != torch.int64 or tuple(ids.shape) != (6,) or ids.device != logits.device:
                raise fail(f"returned {ids.dtype} {tuple(ids.shape)} on {ids.device}")
            if not torch.equal(ids.cpu(), expected):
                raise fail(
                    f"{vocab} {dtype} logits gave {ids.tolist()}, torch.max's indices are "
                    f"{expected.tolist()}"
                )
            same = (logits == before) | (logits.isnan() & before.isnan())
            if not bool(same.all()):
                raise fail("it wrote into the logits")


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


def check_platform_greedy_verifier(platform: Platform) -> None:
    verifier = _kernel_of(
        platform, "fused_greedy_verifier", "verifies greedy drafts with torch ops"
    )
    check_greedy_verifier(verifier, platform.device, _subject(platform))


def check_greedy_verifier(
    verifier: FusedGreedyVerifier,
    device: torch.device,
    subject: str = "fused greedy verifier",
    vocab_size: int = 50,
) -> None:
    """Five requests of 5, 1, 3, 5 and 2 rows (one with fewer valid drafts than rows, a tie
    in a row's logits, rejections at different places) through ``verifier`` and through
    the rejection sampler plus ``Speculator.verify``'s writes: the same token grid,
    emitted counts, row tokens, token table and rejected counts."""

    def fail(detail: str) -> ConformanceFailure:
        return ConformanceFailure(subject, "fused_greedy_verifier", detail)

    rows = [5, 1, 3, 5, 2]
    slots = torch.tensor([3, 0, 6, 1, 4])
    # Request 3 (slot 1) verifies 2 of its 4 drafts (all right up to its fourth): 3 emitted.
    num_valid = torch.tensor([0, 2, 0, 4, 9, 0, 2, 0])
    row_length = 40
    counts = np.array(rows)
    starts = np.cumsum(counts) - counts
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(int(counts.sum()), vocab_size, generator=generator)
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1  # a tie: the first index wins
    argmax = logits.argmax(dim=1)
    # The step's tokens: two padding tokens, then each request's rows; the token fed after
    # row j is row j's draft, right until a wrong one, a different place per request.
    input_ids = torch.randint(0, vocab_size, (len(logits) + 3,), generator=generator)
    input_ids = input_ids.to(torch.int32)
    logits_indices = torch.arange(2, 2 + len(logits))
    for i, (start, count) in enumerate(zip(starts, rows, strict=True)):
        for j in range(count - 1):
            token = int(argmax[start + j])
            input_ids[logits_indices[start + j] + 1] = token if j != i % count else token ^ 1
    last = len(input_ids) - 1
    sample_index = slots * row_length + 10

    request = torch.from_numpy(np.repeat(np.arange(len(rows)), counts))
    position = torch.from_numpy(np.arange(counts.sum()) - np.repeat(starts, counts))
    drafts = input_ids[(logits_indices + 1).clamp(max=last)].to(torch.int64)
    num_verified = torch.minimum(torch.tensor(rows) - 1, num_valid[slots])
    params = SamplingParams(temperature=0.0)
    metadata = SamplingMetadata.build(
        [SamplingRow(params, None)] * len(logits), vocab_size, torch.device("cpu"),
        default_generator=torch.Generator(),
    )  # fmt: skip
    ref = RejectionSampler()(
        logits, metadata, drafts, counts, num_verified, row_map=(request, position)
    )
    ref_table = torch.zeros(8 * row_length, dtype=torch.int32)
    ref_table[sample_index[request] + position] = ref.token_ids[request, position].to(torch.int32)
    ref_rejected = torch.zeros(8, dtype=torch.int32)
    ref_rejected[slots] = (torch.tensor(rows) - ref.num_emitted).to(torch.int32)

    table = torch.zeros(8 * row_length, dtype=torch.int32, device=device)
    rejected = torch.zeros(8, dtype=torch.int32, device=device)
    row_starts = torch.from_numpy(np.append(starts, counts.sum())).to(device)
    grid, num_emitted, emitted = verifier(
        logits.to(device), input_ids.to(device), logits_indices.to(device), last, row_starts,
        slots.to(device), num_valid.to(device), sample_index.to(device), table, rejected,
        max(rows),
    )  # fmt: skip
    if num_emitted.cpu().tolist() != ref.num_emitted.tolist():
        raise fail(f"emitted {num_emitted.tolist()} tokens, the rejection sampler "
                   f"{ref.num_emitted.tolist()}")  # fmt: skip
    if grid.cpu().tolist() != ref.token_ids.tolist():
        raise fail(f"token grid {grid.tolist()}, the rejection sampler's {ref.token_ids.tolist()}")
    if emitted.cpu().tolist() != argmax.tolist():
        raise fail(f"row tokens {emitted.tolist()} are not the rows' argmax {argmax.tolist()}")
    if not torch.equal(table.cpu(), ref_table):
        raise fail("the token table differs from Speculator.verify's writes")
    if not torch.equal(rejected.cpu(), ref_rejected):
        raise fail(f"rejected counts {rejected.tolist()}, expected {ref_rejected.tolist()}")


def check_platform_step_gatherer(platform: Platform) -> None:
    gatherer = _kernel_of(platform, "step_gatherer", "gathers a step's inputs with torch ops")
    check_step_gatherer(gatherer, platform.device, _subject(platform))


def check_step_gatherer(
    gatherer: StepGatherer, device: torch.device, subject: str = "step gatherer"
) -> None:
    """A step of 300 tokens over three requests and a padding row (block offset -1 in the
    all-zero padding slot), block tables 600 entries wide, through ``gatherer`` and
    ``gather_on_device``: every output equal, and nothing written past the step's
    tokens and rows."""
    generator = torch.Generator().manual_seed(0)
    num_slots, width, block_size, row_length = 5, 600, 16, 1000
    block_table = torch.randint(0, 9000, (num_slots, width), generator=generator)
    block_table[num_slots - 1] = 0  # the padding slot
    token_table = torch.randint(0, 50000, (num_slots * row_length,), generator=generator)
    slots = [2, 0, 3, num_slots - 1]
    counts, starts = [150, 1, 148, 1], [37, 900, 0, 0]
    token_index, block_index, block_offset = [], [], []
    for slot, start, count in zip(slots, starts, counts, strict=True):
        positions = range(start, start + count)
        token_index += [slot * row_length + p for p in positions]
        block_index += [slot * width + p // block_size for p in positions]
        block_offset += [p % block_size for p in positions]
    block_offset[-1] = -1  # the padding row's slot: -1

    def step() -> dict[str, torch.Tensor]:
        inputs = dict(
            token_table=token_table, token_index=torch.tensor(token_index),
            block_table=block_table, block_index=torch.tensor(block_index),
            block_offset=torch.tensor(block_offset), slots=torch.tensor(slots),
        )  # fmt: skip
        tensors = {k: v.to(torch.int32).to(device) for k, v in inputs.items()}
        num_tokens, rows = len(token_index), len(slots)
        # One element and one row more than the step: what lies past it stays untouched.
        tensors["input_ids"] = torch.full((num_tokens + 1,), 7, dtype=torch.int32, device=device)
        tensors["slot_mapping"] = torch.full_like(tensors["input_ids"], 7)
        tensors["row_tables"] = torch.full((rows + 1, width), 7, dtype=torch.int32, device=device)
        return tensors

    ref, out = step(), step()
    outputs = ("input_ids", "slot_mapping", "row_tables")
    gather_on_device(
        **{k: v[: len(v) - 1] if k in outputs else v for k, v in ref.items()},
        block_size=block_size,
    )
    gatherer(
        **{k: v[: len(v) - 1] if k in outputs else v for k, v in out.items()},
        block_size=block_size,
    )
    for name in outputs:
        if not torch.equal(out[name].cpu(), ref[name].cpu()):
            raise ConformanceFailure(
                subject, "step_gatherer", f"{name} differs from gather_on_device's"
            )


def check_platform_in_flight_corrector(platform: Platform) -> None:
    corrector = _kernel_of(
        platform, "in_flight_corrector", "corrects in-flight positions with torch ops"
    )
    check_in_flight_corrector(corrector, platform.device, _subject(platform))


def check_in_flight_corrector(
    corrector: InFlightCorrector, device: torch.device, subject: str = "in-flight corrector"
) -> None:
    """A step of four requests (query lengths 5, 1, 71 and 5, two padding tokens after
    them; rejections in flight for two, none for one, one not in flight with a stale
    count) through ``corrector`` and ``correct_on_device``: every buffer equal."""
    row_length, block_size, blocks_per_row = 512, 16, 32
    query_lens, slots, starts = [5, 1, 71, 5], [2, 0, 5, 3], [100, 40, 200, 17]
    positions: list[int] = []
    tokens: list[int] = []
    for slot, start, count in zip(slots, starts, query_lens, strict=True):
        positions += range(start, start + count)
        tokens += [slot * row_length + p for p in range(start, start + count)]
    num_tokens = len(positions)
    positions += [0, 0]
    tokens += [7, 7]

    def step() -> dict[str, torch.Tensor]:
        values = dict(
            token_index=tokens,
            block_index=[
                t // row_length * blocks_per_row + p // block_size
                for t, p in zip(tokens, positions, strict=True)
            ],
            block_offset=[p % block_size for p in positions],
            sample_index=[slots[r] * row_length + starts[r] + 1 for r in (0, 2, 3)],
            slots=slots,
            in_flight=[1, 1, 1, 0],
            sampled=[0, 2, 3],
            seq_lens=[s + c for s, c in zip(starts, query_lens, strict=True)],
            positions=positions[:num_tokens],
            query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).tolist(),
            num_rejected=[0, 9, 3, 4, 9, 2, 9, 9],  # by slot
        )
        return {name: torch.tensor(v, dtype=torch.int32) for name, v in values.items()}

    sizes = dict(row_length=row_length, blocks_per_row=blocks_per_row, block_size=block_size)
    ref = step()
    correct_on_device(**ref, **sizes)
    out = {name: value.to(device) for name, value in step().items()}
    corrector(**out, **sizes)
    for name, value in ref.items():
        if not torch.equal(out[name].cpu(), value):
            raise ConformanceFailure(
                subject, "in_flight_corrector",
                f"{name} is {out[name].tolist()}, correct_on_device gives {value.tolist()}",
            )  # fmt: skip
