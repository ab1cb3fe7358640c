"""``--tool-parser-plugin`` / ``--reasoning-parser-plugin`` (vLLM's flags): a Python file or
module that registers parsers of its own before the server checks the parser names.

A plugin registers with the decorators of the parser packages::

    from pagedlm.entrypoints.openai.tool_parsers import ToolParser, register_tool_parser

    @register_tool_parser("my_format")
    class MyToolParser(ToolParser): ...

and the server is started with ``--tool-parser-plugin my_parsers.py --tool-call-parser
my_format``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path


def load_plugin(location: str, flag: str) -> None:
    """Import ``location``: a ``.py`` file, or a module name on ``sys.path``."""
    try:
        if location.endswith(".py"):
            path = Path(location).resolve()
            if not path.is_file():
                raise SystemExit(f"error: {flag} {location}: no such file.")
            digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
            name = f"pagedlm_parser_plugin_{digest}"
            if name in sys.modules:
                return
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        else:
            importlib.import_module(location)
    except SystemExit:
        raise
    except Exception as error:
        raise SystemExit(
            f"error: {flag} {location} failed to load: {type(error).__name__}: {error}"
        ) from None


def check_parser_args(args: argparse.Namespace) -> None:
    """Load the plugins the flags name, then check ``--tool-call-parser`` and
    ``--reasoning-parser`` against every registered parser; the reasoning parser is the
    engine's too (``reasoning_parser_to_engine``)."""
    from pagedlm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from pagedlm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    reasoning_parser_to_engine(args)
    for flag, location in (
        ("--tool-parser-plugin", args.tool_parser_plugin),
        ("--reasoning-parser-plugin", args.reasoning_parser_plugin),
    ):
        if location:
            load_plugin(location, flag)
    for flag, name, known, plugin_flag in (
        ("--tool-call-parser", args.tool_call_parser, TOOL_PARSERS, "--tool-parser-plugin"),
        (
            "--reasoning-parser",
            args.reasoning_parser,
            REASONING_PARSERS,
            "--reasoning-parser-plugin",
        ),
    ):
        if name and name not in known:
            raise SystemExit(
                f"error: {flag} {name!r} is unknown; choose one of {sorted(known)}, or register "
                f"it in a file given to {plugin_flag}."
            )


def reasoning_parser_to_engine(args: argparse.Namespace) -> None:
    """``--reasoning-parser`` (and ``--reasoning-parser-plugin``) is vLLM's
    ``structured_outputs_config.reasoning_parser`` (and ``reasoning_parser_plugin``): the
    engine applies grammars after the thought its markers delimit. Either spelling sets
    both the server's parser and the engine's; two different parsers exit naming both."""
    config = dict(getattr(args, "structured_outputs_config", None) or {})
    for flag, key in (
        ("--reasoning-parser", "reasoning_parser"),
        ("--reasoning-parser-plugin", "reasoning_parser_plugin"),
    ):
        given, configured = getattr(args, key, None), config.get(key) or None
        if given and configured and given != configured:
            raise SystemExit(
                f"error: {flag} {given!r} and --structured-outputs-config's {key} "
                f"{configured!r} name two; pass one."
            )
        if given or configured:
            setattr(args, key, given or configured)
            config[key] = given or configured
    if config and hasattr(args, "structured_outputs_config"):
        args.structured_outputs_config = config
