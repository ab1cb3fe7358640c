"""Resolving a model name (a local path or a Hugging Face hub id, ``org/name``) to a local
path: a hub id becomes its snapshot directory.

``huggingface_hub.snapshot_download`` does the work: it reuses the local cache
(``$HF_HOME/hub`` or ``$HF_HUB_CACHE``), fetches only what is missing, and with
``HF_HUB_OFFLINE=1`` never touches the network. We restrict it to what pagedlm reads:
the config, tokenizer files and safetensors weights, never ``*.bin``/``*.pt`` pickles or
Python files (``trust_remote_code`` is never honoured for model code).
"""

from __future__ import annotations

import os
import re

HUB_ALLOW_PATTERNS = (
    "*.json",  # config, generation config, tokenizer config, safetensors index
    "*.safetensors",
    "tokenizer*",
    "*.model",  # sentencepiece vocabularies
    "merges.txt",
    "*.jinja",  # chat templates stored beside tokenizer_config.json
)

# Hub ids as the hub itself validates them: one "/" between owner and name, each made of
# letters, digits, "-", "_" and "."; no leading "-"/"." and no "--" or "..".
_HUB_ID = re.compile(r"^(?![.-])[\w.-]{1,96}/(?![.-])[\w.-]{1,96}$")


def looks_like_hub_id(model: str) -> bool:
    """True for ``org/name`` strings that are not an existing local path."""
    return bool(_HUB_ID.match(model)) and ".." not in model and "--" not in model


def _offline() -> bool:
    # Read at call time: huggingface_hub reads the variable once, when it is imported.
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_hub_model(
    repo_id: str, revision: str | None = None, cache_dir: str | None = None
) -> str:
    """The local snapshot directory of ``repo_id`` at ``revision`` (None: the default branch),
    under ``cache_dir`` (None: the Hugging Face cache).

    Raises ``ValueError`` naming the fix when the repository, the revision or (offline) the
    cached copy does not exist.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = _offline()
    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=list(HUB_ALLOW_PATTERNS),
            local_files_only=offline,
            cache_dir=cache_dir,
        )
    except GatedRepoError:
        raise ValueError(
            f"{repo_id} is gated on the Hugging Face hub; accept its license on the model "
            "page and log in (huggingface-cli login or HF_TOKEN), or pass a local directory."
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{repo_id!r} is neither a local path nor a model on the Hugging Face hub; check "
            "the spelling (or log in, if the repository is private)."
        ) from None
    except RevisionNotFoundError:
        raise ValueError(
            f"{repo_id} has no revision {revision!r}; pass an existing branch, tag or commit."
        ) from None
    except LocalEntryNotFoundError:
        if offline:
            raise ValueError(
                f"{repo_id}{at} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                "set; download it once with network access (unset HF_HUB_OFFLINE), point "
                "HF_HOME at a cache that has it, or pass a local directory."
            ) from None
        raise ValueError(
            f"Could not download {repo_id}{at} and it is not cached; check the network "
            "(or set HF_ENDPOINT), or pass a local model directory."
        ) from None
    except HfHubHTTPError as error:
        raise ValueError(
            f"Downloading {repo_id}{at} from the Hugging Face hub failed ({error}); retry, "
            "or pass a local model directory."
        ) from None


def resolve_model_path(
    what: str, name: str, revision: str | None, weights: bool = True, cache_dir: str | None = None
) -> str:
    """A local path as given, else a hub id's snapshot directory; errors name the fix."""
    path = os.path.expanduser(name)
    if os.path.exists(path):
        if revision is not None and weights:
            raise ValueError(
                f"revision={revision!r} applies to hub ids, but {name} is a local path; "
                "drop revision or check out that revision into the directory."
            )
        if os.path.isfile(path) and not path.endswith(".gguf"):
            raise ValueError(
                f"{what} file {path!r} is not a .gguf file; pass a directory or a .gguf file."
            )
        return path
    if looks_like_hub_id(name):
        return resolve_hub_model(name, revision, cache_dir)
    raise ValueError(
        f"{what} {name!r} not found: pass a local Hugging Face model directory "
        "(config.json + *.safetensors), a .gguf file, a hub id (org/name), or model=None "
        "for the embedded default model."
    )
