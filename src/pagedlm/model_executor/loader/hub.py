"""Resolving a model name (a local path or a Hugging Face hub id, ``org/name``) to a local
path: a hub id becomes its snapshot directory.

``huggingface_hub.snapshot_download`` does the work: it reuses the local cache
(``$HF_HOME/hub`` or ``$HF_HUB_CACHE``), fetches only what is missing, and with
``HF_HUB_OFFLINE=1`` never touches the network. We restrict it to what pagedlm reads:
the config, generation config, tokenizer files and chat templates (``HUB_ALLOW_PATTERNS``),
never Python files (``trust_remote_code`` is never honoured for model code), and the weight
files a load reads, by name: the repository is listed first and ``weight_files`` chooses
them from the listing (an index, when there is one, is fetched first and decides), so
neither a second copy of the weights (a single file beside the shards, Mistral's
``consolidated.safetensors``) nor a trainer's ``training_args.bin`` or ``optimizer.pt`` is
downloaded. A load format that reads no weight files (``"dummy"``, a tokenizer's files)
fetches no weights at all.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Collection
from pathlib import Path

from pagedlm.model_executor.loader.weight_files import (
    WEIGHT_FORMATS,
    IndexReader,
    choose_weight_names,
    index_names,
)

logger = logging.getLogger(__name__)

HUB_ALLOW_PATTERNS = (
    "*.json",  # config, generation config, tokenizer config, chat template, weight indexes
    "tokenizer*",
    "*.model",  # sentencepiece vocabularies
    "merges.txt",
    "*.jinja",  # chat templates stored beside tokenizer_config.json
)
"""What pagedlm reads of a repository besides its weights."""
CACHED_WEIGHT_PATTERNS = ("*.safetensors",)
"""The weights asked of the cache when the repository could not be listed (the loader
then chooses among what the snapshot holds)."""

HubToken = bool | str | None
"""vLLM's ``hf_token``: the token itself, True (the one ``hf auth login`` stored), or None
(huggingface_hub's default: ``HF_TOKEN`` or the stored one, when there is one)."""


def check_token(token: HubToken) -> None:
    """A ``ValueError`` naming the fix for a token that cannot be sent (never showing it)."""
    if token is True:
        from huggingface_hub import get_token

        if get_token() is None:
            raise ValueError(
                "hf_token=True (--hf-token without a value) sends the token stored by "
                "`hf auth login` (huggingface-cli login), but none is stored and HF_TOKEN is "
                "unset; log in, or pass the token itself (--hf-token <token>)."
            )
    elif token is not None and not isinstance(token, (bool, str)):
        raise ValueError(
            f"hf_token must be a string (the token), True or None, not a {type(token).__name__}."
        )
    elif isinstance(token, str) and not token.strip():
        raise ValueError("hf_token is empty; pass the token, True for the stored one, or None.")


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
    repo_files: Collection[str] | None,
    load_format: str | None,
    repo_id: str = "the repository",
    read_index: IndexReader | None = None,
) -> list[str]:
    """What to download of a repository whose files are ``repo_files`` (paths, as the hub
    lists them; None: not listed) for ``load_format`` (None: no weights wanted, a tokenizer):
    ``HUB_ALLOW_PATTERNS`` plus, for a format that reads weight files, those
    ``weight_files.choose_weight_names`` picks, by name (``read_index`` reads an index the
    repository has). A ``ValueError`` naming the fix, before any weight is downloaded, where
    the repository has no weights in that format or its index names files it does not have.
    """
    patterns = list(HUB_ALLOW_PATTERNS)
    if load_format not in WEIGHT_FORMATS:
        return patterns  # "dummy" (random weights), "gguf" (a file, not a repository), None
    if repo_files is None:
        return patterns + list(CACHED_WEIGHT_PATTERNS)
    where = f"{repo_id} on the Hugging Face hub"
    chosen = choose_weight_names(repo_files, load_format, where, read_index or _no_index)
    missing = sorted(set(chosen.names) - set(repo_files))
    if missing:
        raise ValueError(
            f"{chosen.index} of {where} lists shard files the repository does not have: "
            f"{', '.join(missing)}; pass a revision where it is complete, or a local directory."
        )
    return patterns + [glob.escape(name) for name in chosen.names]


def _no_index(name: str) -> list[str]:
    raise ValueError(f"{name} was not read (no index reader given).")


def _hub_index_reader(
    repo_id: str, revision: str | None, cache_dir: str | None, token: HubToken
) -> IndexReader:
    """Reads an index of the repository, downloading it (alone, into the cache) first."""

    def read(name: str) -> list[str]:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(repo_id, name, revision=revision, cache_dir=cache_dir, token=token)
        return index_names(Path(path), f"{name} of {repo_id}")

    return read


def _repo_files(repo_id: str, revision: str | None, token: HubToken) -> list[str] | None:
    """The repository's file paths; None when the hub does not answer at all (no network,
    a proxy refusing): the snapshot then comes from the cache, as snapshot_download does."""
    from huggingface_hub import list_repo_files
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return list_repo_files(repo_id, revision=revision, token=token)
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
    token: HubToken = None,
) -> str:
    """The local snapshot directory of ``repo_id`` at ``revision`` (None: the default branch),
    under ``cache_dir`` (None: the Hugging Face cache), with the weight files ``load_format``
    reads (``hub_allow_patterns``; none for "dummy" or None, a tokenizer's files). Every
    request to the hub sends ``token`` (``check_token``).

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
    if not offline:
        check_token(token)
    try:
        listed = not offline and load_format in WEIGHT_FORMATS
        repo_files = _repo_files(repo_id, revision, token) if listed else None
        read_index = _hub_index_reader(repo_id, revision, cache_dir, token)
        patterns = hub_allow_patterns(repo_files, load_format, repo_id, read_index)
        weights = patterns[len(HUB_ALLOW_PATTERNS) :]
        if repo_files is not None:
            logger.info("%s: fetching its weight files %s", repo_id, _shown(weights))
        return snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=patterns,
            local_files_only=offline or (listed and repo_files is None),
            cache_dir=cache_dir,
            token=token,
        )
    except GatedRepoError:
        raise ValueError(
            f"{repo_id} is gated on the Hugging Face hub; accept its license on the model "
            "page and log in (hf auth login, or HF_TOKEN), or pass hf_token, or a local "
            "directory."
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{repo_id!r} is neither a local path nor a model on the Hugging Face hub; check "
            "the spelling (or log in or pass hf_token, if the repository is private)."
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


def _shown(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} and {len(names) - 1} more"


def resolve_model_path(
    what: str,
    name: str,
    revision: str | None,
    weights: bool = True,
    cache_dir: str | None = None,
    load_format: str = "auto",
    token: HubToken = None,
) -> str:
    """A local path as given, else a hub id's snapshot directory (with the weight files
    ``load_format`` reads, when ``weights``; ``token`` sent to the hub); errors name the fix."""
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
        formats = load_format if weights else None
        return resolve_hub_model(name, revision, cache_dir, formats, token)
    raise ValueError(
        f"{what} {name!r} not found: pass a local Hugging Face model directory "
        "(config.json + *.safetensors), a .gguf file, a hub id (org/name), or model=None "
        "for the embedded default model."
    )
