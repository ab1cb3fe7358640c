"""Optional packages a request may need, and the 501 that names the extra to install.

A feature whose package is not installed (a grammar backend, ``jsonschema``) is the
server's gap, not the client's: the answer is 501 with the ``pip install`` that fills it,
never a bare 500. ``missing_package_error`` maps an ``ImportError`` raised anywhere in a
handler; modules this table does not know are named as the package to install.
"""

from __future__ import annotations

from pagedlm.entrypoints.openai.errors import APIError

MISSING_PACKAGE_STATUS = 501
EXTRA_OF_PACKAGE = {
    "jsonschema": "server",
    "xgrammar": "structured",
    "outlines": "structured",
    "outlines_core": "structured",
    "bitsandbytes": "bnb",
    "ray": "ray",
}
"""Top-level module name -> the ``pagedlm[...]`` extra that installs it (pyproject.toml)."""


def install_hint(module: str) -> str:
    """The command that installs ``module`` (its extra when it has one)."""
    top = module.split(".")[0]
    extra = EXTRA_OF_PACKAGE.get(top)
    return f"pip install 'pagedlm[{extra}]'" if extra else f"pip install {top}"


def missing_package_message(error: ImportError, feature: str = "This request") -> str:
    module = error.name or str(error)
    return (
        f"{feature} needs the optional package {module.split('.')[0]!r}, which this server "
        f"does not have; install it with `{install_hint(module)}` and restart the server."
    )


def missing_package_error(error: ImportError, feature: str = "This request") -> APIError:
    """The ``APIError`` (501) for a handler that hit ``error``."""
    return APIError(missing_package_message(error, feature), status=MISSING_PACKAGE_STATUS)
