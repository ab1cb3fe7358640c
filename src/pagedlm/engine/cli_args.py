"""Command-line flags for ``EngineArgs``, generated from its dataclass fields.

The flags are derived once from ``dataclasses.fields(EngineArgs)``: a field added to
``EngineArgs`` becomes a ``--kebab-case`` flag of every subcommand (in the ``--help`` group
``HELP_GROUPS`` gives it, vLLM's). Help text comes from the attribute docstrings in
``arg_utils.py``, and for vLLM's compatibility arguments from ``vllm_compat_args.VLLM_ONLY``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import re
import textwrap
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any

from pagedlm.config import MODEL_IMPL_ALIASES, MODEL_IMPLS
from pagedlm.engine.arg_utils import EngineArgs, _merged
from pagedlm.engine.vllm_aliases import VLLM_LOAD_FORMATS
from pagedlm.engine.vllm_compat_args import VLLM_ONLY, vllm_only_help
from pagedlm.model_executor.loader import LOAD_FORMATS

# Fields that the subcommands take as a positional argument as well as a flag.
POSITIONAL_MODEL_DEST = "model_tag"
SHORT_FLAGS = {
    "quantization": "-q",
    "tensor_parallel_size": "-tp",
    "pipeline_parallel_size": "-pp",
    "data_parallel_size": "-dp",
    "data_parallel_rank": "-dpn",
    "enable_expert_parallel": "-ep",
    "optimization_level": "-O",
    "compilation_config": "-cc",
    "attention_config": "-ac",
    "decode_context_parallel_size": "-dcp",
    "prefill_context_parallel_size": "-pcp",
    "data_parallel_start_rank": "-dpr",
    "data_parallel_size_local": "-dpl",
    "data_parallel_address": "-dpa",
    "data_parallel_rpc_port": "-dpp",
    "data_parallel_backend": "-dpb",
    "data_parallel_hybrid_lb": "-dph",
    "data_parallel_external_lb": "-dpe",
    "nnodes": "-n",
    "node_rank": "-r",
}
"""vLLM's short spellings (``-dpr`` is vLLM's start rank of a node's replicas, not the
rank: pagedlm refuses it but for 0)."""
HELP_GROUPS: dict[str | None, tuple[str, ...]] = {
    "ModelConfig": (
        "model", "tokenizer", "tokenizer_mode", "revision", "tokenizer_revision", "runner",
        "model_impl", "dtype", "seed", "max_model_len", "quantization", "bnb_quant_type",
        "enforce_eager", "max_logprobs", "logprobs_mode", "disable_sliding_window",
        "skip_tokenizer_init", "enable_prompt_embeds", "trust_remote_code",
        "allowed_local_media_path", "allowed_media_domains", "hf_token", "hf_overrides",
        "pooler_config", "generation_config", "override_generation_config",
        "enable_sleep_mode", "logits_processors",
    ),
    "LoadConfig": ("load_format", "download_dir"),
    "AttentionConfig": ("attention_backend",),
    "StructuredOutputsConfig": (
        "structured_outputs_backend", "structured_outputs_max_spec_chars",
        "structured_outputs_compile_timeout_s", "reasoning_parser", "reasoning_parser_plugin",
    ),
    "ParallelConfig": (
        "distributed_executor_backend", "pipeline_parallel_size", "tensor_parallel_size",
        "data_parallel_size", "data_parallel_rank", "enable_expert_parallel",
        "worker_extension_cls",
    ),
    "CacheConfig": (
        "block_size", "gpu_memory_utilization", "kv_cache_memory_bytes", "kv_cache_dtype",
        "num_gpu_blocks_override", "num_kv_blocks", "enable_prefix_caching", "cpu_offload_gb",
        "calculate_kv_scales", "kv_offloading_size", "kv_offloading_backend",
    ),
    "MultiModalConfig": (
        "limit_mm_per_prompt", "mm_processor_kwargs", "media_fetch_timeout_s", "media_max_bytes",
    ),
    "LoRAConfig": ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"),
    "ObservabilityConfig": (),
    "SchedulerConfig": (
        "max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
        "scheduling_policy", "enable_chunked_prefill", "async_scheduling", "stream_interval",
        "max_num_encoder_input_tokens", "encoder_cache_size",
    ),
    "CompilationConfig": ("cudagraph_capture_sizes", "max_cudagraph_capture_size"),
    "VllmConfig": (
        "speculative_config", "kv_transfer_config", "kv_events_config", "compilation_config",
        "structured_outputs_config", "optimization_level",
    ),
    "pagedlm": (
        "platform", "batch_invariant", "engine_iteration_timeout_s",
        "engine_heartbeat_timeout_s",
    ),
    None: ("disable_log_stats", "aggregate_engine_logging"),
}  # fmt: skip
"""``EngineArgs``'s own fields by ``--help`` group, vLLM's (its config classes; None: the
parser's options, as vLLM's ``--disable-log-stats``); ``VllmCompatArgs``'s fields by
their ``VLLM_ONLY`` group."""
GROUP_DESCRIPTIONS = {
    "ModelConfig": "The model, its tokenizer and how it runs.",
    "LoadConfig": "How the weights are read.",
    "AttentionConfig": "The attention backend.",
    "StructuredOutputsConfig": "Grammar-constrained outputs.",
    "ParallelConfig": "Tensor, pipeline, data and expert parallelism.",
    "CacheConfig": "The paged KV cache.",
    "MultiModalConfig": "Image inputs.",
    "LoRAConfig": "LoRA adapters.",
    "ObservabilityConfig": "Metrics and traces.",
    "SchedulerConfig": "What each step runs.",
    "CompilationConfig": "CUDA graphs.",
    "VllmConfig": "Whole-engine configurations, as JSON.",
    "pagedlm": "pagedlm's own engine arguments.",
}
HUMAN_READABLE_INTS = {"max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"}
"""Fields whose flags take ``32k`` or ``1G``, as vLLM's do (``human_readable_int``)."""
MODEL_MAX_SPELLINGS = {"auto", "-1"}
"""``--max-model-len auto`` (or -1): the model's own context length, as None gives."""
FIELD_CHOICES = {
    "load_format": (*LOAD_FORMATS, "bitsandbytes", *VLLM_LOAD_FORMATS),
    "model_impl": (*MODEL_IMPLS, *MODEL_IMPL_ALIASES),
}
"""Fields whose flags take one of a few names (argparse lists them in the usage and refuses
others when parsing). vLLM's weight loaders parse, to be refused at start naming the fix."""

_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


def human_readable_int(text: str) -> int:
    """``4096``, ``32k`` (lower case: powers of 1000, decimals allowed, ``25.6k``) or
    ``16K`` (upper case: powers of 1024, whole numbers only), vLLM's spellings."""
    match = _HUMAN_INT.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count; give digits with an optional k/m/g/t (x1000) or "
            "K/M/G/T (x1024) suffix, e.g. 32k."
        )
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a fraction takes a decimal suffix (k/m/g/t), e.g. {number}{suffix.lower()}."
        )
    return int(number) * _BINARY_SUFFIXES.get(suffix, 1)


human_readable_int.__name__ = "int"


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal right after ``name: type = default``) of
    ``cls`` and the dataclasses it derives from."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _json_object(text: str) -> dict[str, Any] | None:
    """A flag that takes a JSON object (``--speculative-config '{"method": "ngram"}'``)."""
    if text.lower() in ("", "none"):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


_json_object.__name__ = "JSON"


def _scalar_type(annotation: Any) -> tuple[type, bool]:
    """(the non-None type, whether None is allowed) of ``int | None`` style annotations;
    ``dict``-typed fields (a dict or its JSON) give ``dict``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if any(typing.get_origin(a) is dict or a is dict for a in args):
            return dict, True
        if len(args) != 1:
            raise TypeError(f"EngineArgs field type {annotation} has no single CLI type.")
        return args[0], True
    return annotation, False


def _none_or(convert: Any, nones: Collection[str] = ()) -> Any:
    """``convert``, with "none" (and ``nones``) meaning None."""

    def parse(text: str) -> Any:
        return None if text.lower() == "none" or text.lower() in nones else convert(text)

    parse.__name__ = convert.__name__
    return parse


def add_engine_args(
    parser: argparse.ArgumentParser,
    defaults: Mapping[str, Any] | None = None,
    help_texts: Mapping[str, str] | None = None,
) -> argparse.ArgumentParser:
    """Add one ``--flag`` per ``EngineArgs`` field (and ``--no-flag`` for booleans).

    ``defaults`` and ``help_texts`` (keyed by field name) replace a field's default or
    help for this parser only, e.g. a benchmark's ``load_format="dummy"``; the help
    shows the default in force.
    """
    hints = typing.get_type_hints(EngineArgs)
    docs = _field_docs(EngineArgs)
    defaults, help_texts = dict(defaults or {}), dict(help_texts or {})
    unknown = (set(defaults) | set(help_texts)) - EngineArgs.field_names()
    if unknown:
        raise ValueError(f"Not EngineArgs fields: {sorted(unknown)}.")
    groups = _help_groups(parser)
    titles = list(groups)
    # By group, vLLM's order; in a group pagedlm's own fields first, then vLLM's others.
    fields = sorted(
        dataclasses.fields(EngineArgs),
        key=lambda field: (titles.index(_help_group(field.name)), field.name in VLLM_ONLY),
    )
    for field in fields:
        group = groups[_help_group(field.name)]
        flag = "--" + field.name.replace("_", "-")
        flags = (flag, SHORT_FLAGS[field.name]) if field.name in SHORT_FLAGS else (flag,)
        # vLLM's bool | str fields (--hf-token): bare, True; with a value, that string.
        optional_value = set(typing.get_args(hints[field.name])) == {bool, str, type(None)}
        kind, nullable = (str, True) if optional_value else _scalar_type(hints[field.name])
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        default = defaults.get(field.name, default)
        help_text = (
            help_texts.get(field.name)
            or docs.get(field.name)
            or vllm_only_help(field.name)
            or field.name.replace("_", " ")
        )
        if field.name in HUMAN_READABLE_INTS:
            help_text += " Takes 32k (x1000) or 16K (x1024) as well as digits."
        if field.name == "max_model_len":
            help_text += " 'auto' or -1: the model's own context length."
        help_text = help_text.replace("%", "%%") + " (default: %(default)s)"
        if optional_value:
            group.add_argument(
                *flags, type=str, nargs="?", const=True, default=default, help=help_text
            )
            continue
        if kind is bool:
            # --flag / --no-flag; a nullable one stays None (auto) when neither is given.
            group.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        if typing.get_origin(kind) is list:  # one or more: --flag a b
            (item,) = typing.get_args(kind) or (str,)
            item = item if item in (int, float) else None
            group.add_argument(*flags, nargs="+", type=item, default=default, help=help_text)
            continue
        if kind is dict:
            converter: Any = _json_object
        elif kind is int and field.name in HUMAN_READABLE_INTS:
            nones = MODEL_MAX_SPELLINGS if field.name == "max_model_len" else ()
            converter = _none_or(human_readable_int, nones)
        elif kind in (int, float, str):
            converter = _none_or(kind) if nullable else kind
        else:
            raise TypeError(
                f"EngineArgs.{field.name} has type {kind}, which the CLI cannot parse; use "
                "bool, int, float, str or list (optionally | None)."
            )
        choices = FIELD_CHOICES.get(field.name)
        group.add_argument(*flags, type=converter, default=default, choices=choices, help=help_text)
    return parser


def _help_group(name: str) -> str | None:
    for title, names in HELP_GROUPS.items():
        if name in names:
            return title
    return VLLM_ONLY[name].group


def _help_groups(parser: argparse.ArgumentParser) -> dict[str | None, Any]:
    """The engine flags' ``--help`` groups of ``parser``, in vLLM's order (None: the
    parser's own options)."""
    groups: dict[str | None, Any] = {}
    for title in HELP_GROUPS:
        groups[title] = (
            parser if title is None else parser.add_argument_group(title, GROUP_DESCRIPTIONS[title])
        )
    return groups


def json_flags() -> dict[str, str]:
    """Every spelling of a flag that takes a JSON object (an ``EngineArgs`` dict field)
    -> its long flag: ``--compilation-config`` and ``-cc`` -> ``--compilation-config``."""
    hints = typing.get_type_hints(EngineArgs)
    spellings: dict[str, str] = {}
    for field in dataclasses.fields(EngineArgs):
        args = typing.get_args(hints[field.name])
        if not any(a is dict or typing.get_origin(a) is dict for a in args):
            continue
        flag = "--" + field.name.replace("_", "-")
        spellings[flag] = flag
        if field.name in SHORT_FLAGS:
            spellings[SHORT_FLAGS[field.name]] = flag
    return spellings


def dotted_json_flags(argv: list[str]) -> list[str]:
    """vLLM's dotted spelling of a JSON flag's keys, as one JSON object per flag (run
    before ``--flag_name`` spellings are dashed: the keys keep their underscores):
    ``-cc.cudagraph_mode=NONE`` (or ``--compilation-config.cudagraph_mode NONE``), with
    ``--flag.a.b value`` nesting, merged over the flag's own JSON where both are given.
    A value is read as JSON where it parses (numbers, booleans, lists), else as a string.
    Everything after a bare ``--`` stays as given."""
    spellings = json_flags()
    end = argv.index("--") if "--" in argv else len(argv)
    dotted = set()
    for arg in argv[:end]:
        flag, dot, _ = arg.partition("=")[0].partition(".")
        flag = flag.replace("_", "-") if flag.startswith("--") else flag
        if dot and flag in spellings:
            dotted.add(spellings[flag])
    # Only flags spelled dotted somewhere are merged; the others stay for argparse.
    spellings = {k: v for k, v in spellings.items() if v in dotted}
    if not spellings:
        return argv
    objects: dict[str, dict[str, Any]] = {}
    out: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            out += argv[index:]
            break
        name, equals, value = arg.partition("=")
        flag, dot, path = name.partition(".")
        flag = flag.replace("_", "-") if flag.startswith("--") else flag
        if flag in spellings and (dot or equals or index + 1 < len(argv)):
            long = spellings[flag]
            if not dot:  # the whole object: --flag JSON or --flag=JSON
                if not equals:
                    index += 1
                    value = argv[index]
                try:
                    merged = _json_object(value)
                except argparse.ArgumentTypeError as error:
                    raise SystemExit(f"error: argument {flag}: {error}") from None
                objects[long] = _merged(objects.get(long, {}), merged or {})
                if long not in out:
                    out.append(long)
                index += 1
                continue
            if not equals:
                if index + 1 >= len(argv):
                    raise SystemExit(f"error: {name} needs a value (e.g. {name}=VALUE).")
                index += 1
                value = argv[index]
            keys = path.split(".")
            if not all(keys):
                raise SystemExit(f"error: {name}: empty key in the dotted flag.")
            nested: dict[str, Any] = {keys[-1]: _json_value(value)}
            for key in reversed(keys[:-1]):
                nested = {key: nested}
            objects[long] = _merged(objects.get(long, {}), nested)
            if long not in out:
                out.append(long)
            index += 1
            continue
        out.append(arg)
        index += 1
    result: list[str] = []
    for arg in out:
        result.append(arg)
        if arg in objects:
            result.append(json.dumps(objects[arg]))
    return result


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def engine_args_from_cli(namespace: argparse.Namespace) -> EngineArgs:
    """``EngineArgs`` from parsed flags; a positional MODEL wins over ``--model``."""
    values = {
        field.name: getattr(namespace, field.name)
        for field in dataclasses.fields(EngineArgs)
        if hasattr(namespace, field.name)
    }
    positional = getattr(namespace, POSITIONAL_MODEL_DEST, None)
    if positional is not None:
        if values.get("model") not in (None, positional):
            raise SystemExit(
                f"error: MODEL given twice ({positional!r} and --model {values['model']!r}); "
                "pass it once."
            )
        values["model"] = positional
    return EngineArgs(**values)
