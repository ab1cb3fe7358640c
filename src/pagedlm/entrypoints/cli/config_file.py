"""``--config FILE``: a subcommand's flags from a YAML file (vLLM's ``--config``).

Keys are the flags' long names without the dashes (``max-model-len`` or
``max_model_len``), ``model`` included; values are what the flag takes (``true``/``false``
for switches, a list for flags of several values, a mapping for JSON flags). A flag given
on the command line wins over the file, which wins over the defaults.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

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
    """The file's values keyed by the parser's destinations; unknown keys are an error
    that names them."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise SystemExit(f"error: --config {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise SystemExit(f"error: --config {path} is not YAML: {error}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise SystemExit(f"error: --config {path} must hold a mapping of flag names to values.")
    destinations = {
        action.dest for action in parser._actions if action.dest not in ("help", CONFIG_DEST)
    }
    defaults: dict[str, Any] = {}
    unknown = []
    for key, value in values.items():
        dest = str(key).removeprefix("--").replace("-", "_")
        if dest not in destinations:
            unknown.append(str(key))
        else:
            defaults[dest] = value
    if unknown:
        raise SystemExit(
            f"error: --config {path}: unknown option(s) {unknown}; use the long flag names "
            f"of `pagedlm {parser.prog.split()[-1]} --help` without the dashes."
        )
    return defaults
