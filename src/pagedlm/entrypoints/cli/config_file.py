"""``--config FILE``: a subcommand's flags from a YAML file (vLLM's ``--config``).

Keys are the flags' long names without the dashes (``max-model-len`` or
``max_model_len``), ``model`` included; values are what the flag takes (``true``/``false``
for switches, a list for flags of several values, a mapping for JSON flags). A flag given
on the command line wins over the file, which wins over the defaults.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, NoReturn

CONFIG_DEST = "config"


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        dest=CONFIG_DEST,
        default=None,
        metavar="FILE",
        help="A YAML file of flags (keys: the long flag names, e.g. max-model-len: 4096); "
        "flags on the command line take precedence.",
    )


def config_defaults(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's values keyed by the parser's destinations, each checked and converted
    as the flag would be on the command line; a bad file, an unknown key or a value the
    flag refuses exits with status 2 naming it."""
    import yaml

    def fail(message: str) -> NoReturn:
        parser.error(f"--config {path}: {message}")

    try:
        values = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        fail(f"{error.strerror}.")
    except yaml.YAMLError as error:
        parser.error(f"--config {path} is not YAML: {error}")
    if values is None:
        return {}
    if not isinstance(values, dict):
        fail("must hold a mapping of flag names to values.")
    actions = {
        action.dest: action
        for action in parser._actions
        if action.dest not in ("help", CONFIG_DEST) and action.option_strings
    }
    defaults: dict[str, Any] = {}
    unknown = []
    for key, value in values.items():
        dest = str(key).removeprefix("--").replace("-", "_")
        if dest not in actions:
            unknown.append(str(key))
            continue
        try:
            defaults[dest] = _flag_value(parser, actions[dest], value)
        except argparse.ArgumentError as error:
            fail(f"{key}: {error.message}")
    if unknown:
        fail(
            f"unknown option(s) {unknown}; use the long flag names of "
            f"`pagedlm {parser.prog.split()[-1]} --help` without the dashes."
        )
    return defaults


def _shown(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def _flag_value(parser: argparse.ArgumentParser, action: argparse.Action, value: Any) -> Any:
    """What ``action``'s flag gives for the file's ``value`` (null: None); an
    ``ArgumentError`` where the command line would refuse it."""
    flag = action.option_strings[0] if action.option_strings else action.dest
    if value is None:
        return None
    if action.nargs == 0:  # a switch: --flag (and --no-flag)
        if not isinstance(value, bool):
            raise argparse.ArgumentError(None, f"takes true or false, not {value!r}")
        return value
    if action.nargs == "?" and isinstance(value, bool):  # --hf-token: bare or with a value
        return value
    if action.nargs in ("+", "*"):  # one or more values: a list, or one of them
        items = value if isinstance(value, list) else [value]
        return [_scalar_value(parser, action, flag, item) for item in items]
    if isinstance(value, (dict, list)):  # a flag of JSON text: the file's value as its text
        if action.type is not None:
            return parser._get_value(action, json.dumps(value))
        if action.metavar == "JSON":  # read later, from text or a mapping alike
            return value
    return _scalar_value(parser, action, flag, value)


def _scalar_value(
    parser: argparse.ArgumentParser, action: argparse.Action, flag: str, value: Any
) -> Any:
    """One value through the flag's type and choices, as its text on the command line."""
    if isinstance(value, (bool, dict, list)):
        raise argparse.ArgumentError(None, f"{_shown(value)} is not a value of {flag}")
    converted = parser._get_value(action, str(value))
    parser._check_value(action, converted)
    return converted
