"""A real ``pagedlm serve`` in a subprocess, over a tiny random llama with a byte-level
tokenizer and a ChatML chat template.

The tokenizer has one token per byte (no merges), so random outputs exercise multi-byte
UTF-8 handling; ids 0-2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (EOS).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 384
EOS_ID = 2


THINK_TOKENS = ["<think>", "</think>"]
"""With ``thinking``: Qwen3's markers as added tokens (not special, as Qwen3's), the last
two ids of the vocabulary."""
THINK_START_ID, THINK_END_ID = VOCAB_SIZE - 2, VOCAB_SIZE - 1


def _write_tokenizer(path: Path, thinking: bool = False) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = [f"{a}{b}" for a in "abcdefghijklmnop" for b in "qrstuvwxyz0123456"]
    tokens = SPECIAL_TOKENS + byte_chars
    extra = THINK_TOKENS if thinking else []
    tokens += fillers[: VOCAB_SIZE - len(tokens) - len(extra)] + extra
    assert len(tokens) == VOCAB_SIZE
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(path)


def write_chat_checkpoint(path: Path, thinking: bool = False) -> Path:
    """A tiny random llama with tokenizer and chat template (fp32, seeded) in ``path``;
    ``thinking``: the tokenizer has ``<think>`` and ``</think>`` (``THINK_TOKENS``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=EOS_ID,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    _write_tokenizer(path, thinking)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    model: str
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def start_server(model: Path | str, log: Path, *extra: str, wait: bool = True) -> Server:
    """``pagedlm serve`` on a free port; waits until /health answers 200 unless ``wait`` is
    False (then call ``wait_healthy``: the caller can do other work while it boots)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "pagedlm.entrypoints.cli.main", "serve", str(model),
        "--port", str(port), "--served-model-name", "tiny", "--num-kv-blocks", "64",
        "--max-num-seqs", "64", "--log-level", "warning", *extra,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = open(log, "wb")  # noqa: SIM115 - the server writes it until it exits
    process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(process, f"http://127.0.0.1:{port}", "tiny", log)
    if wait:
        wait_healthy(server)
    return server


def wait_healthy(server: Server, timeout: float = 180.0) -> None:
    """Until ``server``'s /health answers 200; stops it and raises if it exits or times out."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"pagedlm serve exited with {server.process.returncode}:\n{server.log_text()}"
            )
        try:
            if httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"pagedlm serve did not become healthy:\n{server.log_text()}")
        time.sleep(0.2)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        children.extend(int(c) for c in text)
    return children


def in_process_app(model: Path | str, name: str = "tiny", /, **options: object):
    """(engine, app): a real ``AsyncLLM`` (its engine core in a child process) behind the
    HTTP app, served in this process (drive it with ``httpx.ASGITransport``). ``options``
    are ``EngineArgs`` fields, or ``ServingContext`` fields (server flags) where
    ``EngineArgs`` has none, or ``admin`` / ``http`` (the app's ``AdminOptions`` and
    ``HttpOptions``). The app's
    ``tokenizer`` attribute is the engine's, for the tests' references; the caller shuts
    the engine down."""
    import dataclasses

    from pagedlm import AsyncLLM
    from pagedlm.engine.arg_utils import EngineArgs
    from pagedlm.entrypoints.openai.app import build_app
    from pagedlm.entrypoints.openai.serving_engine import ServingContext
    from pagedlm.metrics.prometheus import PrometheusMetrics

    admin = options.pop("admin", None)  # build_app's AdminOptions and HttpOptions
    http = options.pop("http", None)
    engine_fields = {field.name for field in dataclasses.fields(EngineArgs)}
    engine_options = {k: v for k, v in options.items() if k in engine_fields}
    context_options = {k: v for k, v in options.items() if k not in engine_fields}
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model), **engine_options))
    context_options.setdefault(
        "structured_outputs_after_reasoning",
        engine.config.structured_outputs_reasoning is not None,
    )
    ctx = ServingContext(
        engine=engine,
        model_names=[name],
        metrics=PrometheusMetrics(name),
        tokenizer=engine.get_tokenizer(),
        max_model_len=engine.config.model.max_model_len,
        runner=engine.config.model.runner,
        **context_options,
    )
    app = build_app(ctx, admin=admin, http=http)
    app.tokenizer = engine.get_tokenizer()
    return engine, app


def asgi_post_scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    """The ASGI scope uvicorn builds for a POST to ``path`` (ASGI spec 2.3: starlette
    then watches for ``http.disconnect``)."""
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip


def statuses_of_a_dropped_upload(app, path: str, first_part: bytes) -> list[int]:
    """POST to ``app`` a body announced longer than ``first_part``, whose client
    disconnects after sending that part; the response statuses the app sent."""
    import asyncio

    scope = asgi_post_scope(path, [(b"content-length", str(10 * len(first_part)).encode())])
    messages = [
        {"type": "http.request", "body": first_part, "more_body": True},
        {"type": "http.disconnect"},
    ]
    statuses = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # nothing more ever comes
        return {}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    return statuses
