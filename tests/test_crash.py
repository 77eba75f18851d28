"""Crash faults on real processes: the tracker SIGKILLed mid-session (decoding goes on; a new
session waits for the restarted tracker, or fails with a clear error when none comes), and the
snapshot store's disk full under a decoding session (decode unaffected, the failures counted).

The full disk is real: the cache server's JetStream store is a 3 MB tmpfs mounted in a user
namespace (``unshare -rm``: no root needed), so its writes fail with ENOSPC as on a full disk."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from neuron_bus import messages as M
from neuron_bus.client import NeuronClient, RouteError
from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.natsserver import NatsServer, ServerConfig, free_port, nats_server_binary

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPT = "The three primary colors are"
STORE_BYTES = 3 << 20


def user_namespaces_work() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


class TmpfsNats(NatsServer):
    """A nats-server whose JetStream store is a tmpfs of ``size`` bytes, mounted in its own user
    and mount namespace: a disk that fills up, for a process without privileges."""

    def __init__(self, root: Path, size: int):
        root.mkdir(parents=True, exist_ok=True)
        cfg = ServerConfig(store_dir=root / "js", port=free_port(), http_port=free_port(), server_name="cache")
        super().__init__(cfg, log_path=root / "nats-server.log")
        self.root, self.size = root, size

    def start(self, timeout: float = 20.0) -> TmpfsNats:
        store = self.config.store_dir
        store.mkdir(parents=True, exist_ok=True)
        conf = self.root / "cache.conf"
        conf.write_text(self.config.render())
        mount = f"mount -t tmpfs -o size={self.size} tmpfs {store} && exec {nats_server_binary()} -c {conf}"
        with open(self.log_path, "ab") as log:  # exec: the PID is the server's, stopped by PID as usual
            self.proc = subprocess.Popen(
                ["unshare", "-rm", "sh", "-c", mount], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.wait_ready(timeout)
        return self


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    if not user_namespaces_work():
        pytest.skip("unshare -rm (user namespaces) is not available: no unprivileged small filesystem")
    srv = TmpfsNats(tmp_path_factory.mktemp("fullfs"), STORE_BYTES).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def swarm(smollm2_path, tmp_path_factory, cache):
    extra = ["--snapshot-every", "4", "--snapshot-nats", cache.url]
    s = LocalSwarm(smollm2_path, 2, workdir=tmp_path_factory.mktemp("crash"), worker_extra={0: extra, 1: extra})
    s.start()
    yield s
    s.stop()


async def timed_generation(url: str, ids: list[int], n: int, on_token=None, **kw):
    """(tokens, the longest wait between two tokens)."""
    tokens, gaps, last = [], [], None
    async with await NeuronClient.connect(url, **kw) as c:
        async for ev in c.generate(prompt_tokens=ids, sampling=M.SamplingParams(max_tokens=n, ignore_eos=True)):
            if isinstance(ev, M.TokenDelta):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                tokens.append(ev.token_id)
                if on_token:
                    on_token(len(tokens))
    return tokens, max(gaps, default=0.0)


async def snapshot_counts(url: str, nodes: list[str]) -> dict[str, tuple[int, dict[str, int]]]:
    async with await NeuronClient.connect(url) as c:
        return {n: ((r := await c.sessions(n)).snapshots_written, dict(r.snapshot_failures)) for n in nodes}


def test_a_full_disk_under_the_snapshot_store_leaves_decode_alone_and_counts_the_failures(swarm, cache, reference):
    ids = reference.tokenizer.encode(PROMPT * 6)
    # a snapshot every 4 positions, ~12 KB per position and hop: the 3 MB store is full within seconds,
    # and the writes that hit it (ENOSPC or the server's own store limit) fail while decode goes on
    n = 200
    nodes = [w.node_id for w in swarm.workers]
    tokens, gap = asyncio.run(timed_generation(swarm.url, ids, n))
    assert tokens == reference(ids, n)
    assert gap < 3.0, f"a token waited {gap:.1f}s: snapshot writes held up decode"
    deadline = time.monotonic() + 30  # an upload still in flight at the end fails within its timeout
    while True:
        counts = asyncio.run(snapshot_counts(swarm.url, nodes))
        failed = sum(f.get("error", 0) + f.get("timeout", 0) for _, f in counts.values())
        if failed or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert failed > 0, counts  # writes the full store refused, counted by reason
    for node, (written, failures) in counts.items():
        assert sum(failures.values()) > 0, (node, written, failures)
    log = Path(cache.log_path).read_text()
    assert "no space left on device" in log or "resource limits exceeded" in log
    print(f"full snapshot disk: longest token gap {gap:.2f}s; snapshots written/failed per hop: {counts}")


def test_the_tracker_sigkilled_mid_session_decoding_goes_on_and_new_sessions_wait_for_it(swarm, reference):
    ids = reference.tokenizer.encode(PROMPT)
    n = 40
    killed = threading.Event()

    def kill_at(count: int) -> None:
        if count == 5 and not killed.is_set():
            swarm.kill("tracker")  # SIGKILL
            killed.set()

    tokens, _ = asyncio.run(timed_generation(swarm.url, ids, n, on_token=kill_at))
    assert killed.is_set() and swarm.procs["tracker"].returncode == -9
    assert tokens == reference(ids, n)  # the active session never needed the tracker
    # a new session while there is no tracker: it waits, and runs once a tracker is back
    result: dict = {}

    def new_session() -> None:
        start = time.monotonic()
        result["tokens"], _ = asyncio.run(timed_generation(swarm.url, ids, 8, tracker_wait=60))
        result["waited"] = time.monotonic() - start

    thread = threading.Thread(target=new_session)
    thread.start()
    time.sleep(3.0)
    assert thread.is_alive() and "tokens" not in result
    swarm.respawn("tracker")
    thread.join(120)
    assert result["tokens"] == reference(ids, 8) and result["waited"] >= 3.0, result


def test_with_no_tracker_coming_back_a_new_session_fails_with_a_clear_error(swarm, reference):
    ids = reference.tokenizer.encode(PROMPT)
    swarm.kill("tracker")
    try:
        start = time.monotonic()
        with pytest.raises(RouteError) as failed:
            asyncio.run(timed_generation(swarm.url, ids, 4, tracker_wait=3.0))
        waited = time.monotonic() - start
        assert failed.value.reason == "no_tracker" and 3.0 <= waited < 15.0, waited
        assert "no tracker answered on neuron.route.request for 3s" in str(failed.value)
        assert "neuron-bus tracker" in str(failed.value)
    finally:
        swarm.respawn("tracker")
