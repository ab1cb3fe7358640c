"""Resolving a model name (a local path or a Hugging Face hub id, ``org/name``) to a local
path: a hub id becomes its snapshot directory.

``huggingface_hub.snapshot_download`` does the work: it reuses the local cache
(``$HF_HOME/hub`` or ``$HF_HUB_CACHE``), fetches only what is missing, and with
``HF_HUB_OFFLINE=1`` never touches the network. We restrict it to what pagedlm reads:
the config, tokenizer files and safetensors weights, never Python files
(``trust_remote_code`` is never honoured for model code). A repository without
safetensors weights (or ``load_format="pt"``) gets its PyTorch weight files instead, by
name, as ``weight_files`` chooses them from the repository's listing: never a trainer's
``training_args.bin`` or ``optimizer.pt``, which can be larger than the model.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable

from pagedlm.model_executor.loader.weight_files import (
    SAFETENSORS_INDEX_FILE,
    pickle_weight_names,
)

logger = logging.getLogger(__name__)

HUB_ALLOW_PATTERNS = (
    "*.json",  # config, generation config, tokenizer config, safetensors index
    "*.safetensors",
    "tokenizer*",
    "*.model",  # sentencepiece vocabularies
    "merges.txt",
    "*.jinja",  # chat templates stored beside tokenizer_config.json
)
PICKLE_FORMATS = ("auto", "pt")
"""The load formats that may read a repository's PyTorch files (so its listing is asked for)."""

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


def hub_allow_patterns(
    repo_files: Iterable[str] | None, load_format: str | None, repo_id: str = "the repository"
) -> list[str]:
    """What to download of a repository whose files are ``repo_files`` (paths, as the hub
    lists them; None: not listed) for ``load_format`` (None: no weights wanted, a tokenizer):
    ``HUB_ALLOW_PATTERNS``, with the safetensors replaced by the PyTorch weight files where
    ``"auto"`` finds no safetensors at the root or ``"pt"`` asks for them (a ``ValueError``
    where it asks for them and there are none, before anything is downloaded)."""
    patterns = list(HUB_ALLOW_PATTERNS)
    if repo_files is None or load_format not in PICKLE_FORMATS:
        return patterns
    root = [path for path in repo_files if "/" not in path]
    safetensors = any(n.endswith(".safetensors") or n == SAFETENSORS_INDEX_FILE for n in root)
    pickles = pickle_weight_names(root)
    if load_format == "pt" and not pickles:
        has = " (it has *.safetensors files: use load_format='auto')" if safetensors else ""
        raise ValueError(
            "load_format='pt' reads PyTorch weight files (pytorch_model*.bin, other *.bin, "
            f"or *.pt), but {repo_id} on the Hugging Face hub has none{has}."
        )
    if (load_format == "auto" and safetensors) or not pickles:
        return patterns  # an "auto" repository with neither: the loader's error says so
    return [pattern for pattern in patterns if pattern != "*.safetensors"] + pickles


def _repo_files(repo_id: str, revision: str | None) -> list[str] | None:
    """The repository's file paths; None when the hub does not answer at all (no network,
    a proxy refusing): the snapshot then comes from the cache, as snapshot_download does."""
    from huggingface_hub import list_repo_files
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return list_repo_files(repo_id, revision=revision)
    except HfHubHTTPError:
        raise  # the hub answered (no such repository or revision, gated): the caller says so
    except Exception as error:  # a transport error, whatever the HTTP library's class
        logger.warning(
            "Could not list %s on the Hugging Face hub (%s); looking in the local cache.",
            repo_id,
            error,
        )
        return None


def resolve_hub_model(
    repo_id: str,
    revision: str | None = None,
    cache_dir: str | None = None,
    load_format: str | None = "auto",
) -> str:
    """The local snapshot directory of ``repo_id`` at ``revision`` (None: the default branch),
    under ``cache_dir`` (None: the Hugging Face cache), with the weight files ``load_format``
    reads (``hub_allow_patterns``; None: a tokenizer's files).

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
        listed = not offline and load_format in PICKLE_FORMATS
        repo_files = _repo_files(repo_id, revision) if listed else None
        patterns = hub_allow_patterns(repo_files, load_format, repo_id)
        pickles = [pattern for pattern in patterns if pattern not in HUB_ALLOW_PATTERNS]
        if pickles:
            logger.info("%s: fetching its PyTorch weight files %s", repo_id, ", ".join(pickles))
        return snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=patterns,
            local_files_only=offline or (listed and repo_files is None),
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
    what: str,
    name: str,
    revision: str | None,
    weights: bool = True,
    cache_dir: str | None = None,
    load_format: str = "auto",
) -> str:
    """A local path as given, else a hub id's snapshot directory (with the weight files
    ``load_format`` reads, when ``weights``); errors name the fix."""
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
        return resolve_hub_model(name, revision, cache_dir, load_format if weights else None)
    raise ValueError(
        f"{what} {name!r} not found: pass a local Hugging Face model directory "
        "(config.json + *.safetensors), a .gguf file, a hub id (org/name), or model=None "
        "for the embedded default model."
    )
