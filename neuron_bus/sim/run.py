"""scripts/swarm_sim: a simulated swarm against a real nats-server and real tracker processes.

    scripts/swarm_sim [--nodes N] [--trackers K] [--duration S] [--churn SPEC] [--json PATH]
                      [--route-rate R] [--coverage-rate C] [--concurrency Q] [--throughput-seconds T]
                      [--kill-tracker-at S] [--seed X]

One run, all on this machine: a nats-server; K ``neuron-bus tracker`` processes; the node pool
(neuron_bus/sim/pool.py, one process for every simulated node); and this process as the clients.

1. warm-up: the pool announces N nodes and heartbeats; wait until a route is answered and the
   trackers had time to see every node (at least the heartbeat expiry);
2. idle window: heartbeats and pings only: what the swarm costs the trackers and the server;
3. latency phase (``--duration`` s): route requests at ``--route-rate`` per second (10% of policy
   private), coverage requests at ``--coverage-rate``, sent on time (open loop); churn runs
   throughout; ``--kill-tracker-at`` SIGKILLs tracker 0 that many seconds into it;
4. throughput phase: ``--concurrency`` clients asking back to back for ``--throughput-seconds``.

Figures: route and coverage latency percentiles, route throughput, each tracker's CPU share (1.0
= one core) and peak RSS, the server's CPU and message rates, decision quality (quality.py), and
the checks: every route complete, ordered, of real nodes, honouring its policy, and never through
a node whose last heartbeat is older than the expiry when the request was sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nats.js.errors

from neuron_bus import messages as M
from neuron_bus import subjects as S
from neuron_bus.natsserver import NatsServer
from neuron_bus.sim import probe as P
from neuron_bus.sim import swarm
from neuron_bus.sim.procs import Proc, SimError, Usage, start_server, start_tracker, varz
from neuron_bus.sim.quality import Judge, search_ratio
from neuron_bus.topology import connect, ensure_topology
from neuron_bus.tracker.params import TrackerParams
from workers.errors import Reason

GONE_SLACK_S = 1.0  # delivery and scheduling slack on top of the expiry, on a loaded machine


@dataclass
class Options:
    nodes: int = 1000
    trackers: int = 1
    duration: float = 20.0
    churn: str = "0.01"
    route_rate: float = 20.0
    coverage_rate: float = 0.5
    concurrency: int = 16
    throughput_seconds: float = 5.0
    idle_seconds: float = 3.0
    kill_tracker_at: float | None = None
    seed: int = 1
    expiry: float = 5.0
    warmup: float | None = None  # None: long enough for the trackers' pings to reach every node once
    quality_samples: int = 200
    tracker_args: tuple[str, ...] = ()
    profile_dir: str | None = None  # write each tracker's cProfile stats here
    timeout: float = 3.0  # seconds a route request waits for its answer (then once more)
    tracker_pythonpath: str | None = None  # run another checkout's tracker (compare versions)


def warmup_seconds(opts: Options) -> float:
    """A tracker that has been running a while has measured every node's round trip a few times:
    wait for its pings (half of TrackerParams.ping_budget a round for the swarm at large) to go
    round the swarm three times, at least 8 s (10,000 nodes: 150 s)."""
    if opts.warmup is not None:
        return max(opts.warmup, opts.expiry + 1)
    p = TrackerParams()
    return max(8.0, opts.expiry + 1, 3 * opts.nodes / (p.ping_budget / 2) * p.ping_interval)


def percentiles(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] * scale, 2)

    return {"n": len(ordered), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(ordered[-1] * scale, 2)}


def _rates(before: dict, after: dict, seconds: float) -> dict:
    return {
        key + "_per_s": round((after[key] - before[key]) / seconds, 1)
        for key in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")
    }


async def _warm(nc, probe: P.Probe, opts: Options, ready_at: float) -> None:
    deadline = time.monotonic() + 120
    while True:
        r = await probe.route(keep=False)
        if isinstance(r.reply, M.RouteAssignment):
            break
        if time.monotonic() > deadline:
            raise SimError(Reason.NO_ROUTE, f"no route after 120s of warm-up: {r.reply or r.error}")
        await asyncio.sleep(0.5)
    left = ready_at + warmup_seconds(opts) - time.time()
    if left > 0:
        await asyncio.sleep(left)


async def _lost(nc, routes: list[M.RouteAssignment]) -> int:
    """How many of ``routes`` are no longer recorded as assigned (KV neuron-routes)."""
    kv = await nc.jetstream().key_value(S.KV_ROUTES)
    lost = 0
    for route in routes:
        try:
            stored = M.decode((await kv.get(route.route_id)).value, M.RouteAssignment)
            lost += stored != route
        except nats.js.errors.KeyNotFoundError:
            lost += 1
    return lost


def _checks(results: list[P.RouteResult], truth: dict[str, swarm.SimNode], gone: dict, expiry: float) -> dict:
    counts = {
        "requests": len(results),
        "routes": 0,
        "rejections": 0,
        "unanswered": 0,
        "answered_on_retry": 0,
        "bad_routes": 0,
        "through_gone_after_expiry": 0,
        "through_gone_within_expiry": 0,
    }
    examples: list[str] = []
    for r in results:
        if r.reply is None:
            counts["unanswered"] += 1
            continue
        if r.attempts > 1:
            counts["answered_on_retry"] += 1
        if isinstance(r.reply, M.RouteRejection):
            counts["rejections"] += 1
            if len(examples) < 5:
                examples.append("rejected: " + "; ".join(r.reply.reasons)[:300])
            continue
        counts["routes"] += 1
        problem = P.check_route(r.reply, truth, r.policy)
        if problem:
            counts["bad_routes"] += 1
            examples.append(problem)
        for h in r.reply.hops:
            g = gone.get(h.node_id)
            if g is None:
                continue
            last = g["last_beat"] or g["at"]
            if r.sent > last + expiry + GONE_SLACK_S:
                counts["through_gone_after_expiry"] += 1
                examples.append(f"{h.node_id} silent since {r.sent - last:.1f}s on a route")
            elif r.sent > g["at"]:
                counts["through_gone_within_expiry"] += 1
    return {**counts, "examples": examples[:10]}


def _quality(results: list[P.RouteResult], judge: Judge, t0: float, limit: int, search_checks: int = 10) -> dict:
    ratios: list[float] = []
    search: list[float] = []
    anything: list[float] = []
    for r in results:
        if r.sessions is None or not isinstance(r.reply, M.RouteAssignment):
            continue
        verdict = judge.judge(r.reply, r.sent - t0, r.sessions, r.policy)
        if verdict is not None:
            ratios.append(verdict["ratio"])
            anything.append(verdict["ratio_any"])
        if len(search) < search_checks and len(ratios) % 10 == 1:
            ratio = search_ratio(judge.eligible(r.sent - t0, r.sessions, r.policy), r.policy, judge.params)
            if ratio is not None:
                search.append(ratio)
        if len(ratios) >= limit:
            break
    if not ratios:
        return {"n": 0}
    ratios.sort()
    return {
        "n": len(ratios),
        "median_ratio": round(statistics.median(ratios), 4),
        "mean_ratio": round(statistics.fmean(ratios), 4),
        "p90_ratio": round(ratios[int(0.9 * (len(ratios) - 1))], 4),
        "max_ratio": round(ratios[-1], 4),
        "within_5pct": round(sum(x <= 1.05 for x in ratios) / len(ratios), 3),
        "median_ratio_with_stragglers": round(statistics.median(anything), 4),
        "search_on_truth": {"n": len(search), "max_ratio": round(max(search), 4) if search else None},
    }


def _swarm_spec(opts: Options) -> swarm.SwarmSpec:
    """The simulated nodes: churn long enough to outlast every phase."""
    return swarm.SwarmSpec(
        nodes=opts.nodes,
        seed=opts.seed,
        duration=warmup_seconds(opts) + opts.idle_seconds + opts.duration + opts.throughput_seconds + 30,
        churn=swarm.Churn.parse(opts.churn),
    )


def _start_trackers(opts: Options, server_url: str, workdir: Path) -> list[Proc]:
    extra = list(opts.tracker_args)
    profile = Path(opts.profile_dir) if opts.profile_dir else None
    return [
        start_tracker(i, server_url, opts.expiry, extra, workdir, profile, opts.tracker_pythonpath)
        for i in range(opts.trackers)
    ]


def _start_pool(opts: Options, server_url: str, spec: swarm.SwarmSpec, t0: float, workdir: Path) -> Proc:
    """The node pool process playing ``spec``'s nodes, its churn timed from wall time ``t0``."""
    return Proc.start(
        "node pool",
        [
            sys.executable,
            "-m",
            "neuron_bus.sim.pool",
            "--nats",
            server_url,
            "--nodes",
            str(opts.nodes),
            "--seed",
            str(opts.seed),
            "--duration",
            str(spec.duration),
            "--churn",
            opts.churn,
            "--t0",
            str(t0),
            "--max-seconds",
            str(spec.duration + 120),
        ],
        workdir / "pool.log",
    )


async def _idle_phase(opts: Options, server: NatsServer, pids: dict[str, int]) -> dict:
    """Heartbeats and pings only: what the swarm costs the processes and the bus."""
    usage, v0 = Usage(pids), varz(server)
    usage.start()
    await asyncio.sleep(opts.idle_seconds)
    return {"usage": usage.stop(), "bus": _rates(v0, varz(server), opts.idle_seconds)}


async def _latency_phase(
    opts: Options, server: NatsServer, pids: dict[str, int], probe: P.Probe, trackers: list[Proc]
) -> tuple[dict, float | None]:
    """Route and coverage requests sent on time for ``opts.duration`` (tracker 0 killed on the way
    if asked): the phase's figures, and when tracker 0 was killed (wall time; None: it was not)."""
    usage, v0, t_lat = Usage(pids), varz(server), time.monotonic()
    usage.start()
    killed: dict[str, float] = {}  # "at": when tracker 0 was killed (wall time)
    if opts.kill_tracker_at is not None:

        async def kill_later():
            await asyncio.sleep(opts.kill_tracker_at)
            usage.sample()
            killed["at"] = time.time()
            trackers[0].kill()

        killer = asyncio.create_task(kill_later())
    sampler_stop = asyncio.Event()

    async def sample():
        while not sampler_stop.is_set():
            usage.sample()
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample())
    await probe.open_loop(opts.route_rate, opts.duration, opts.coverage_rate)
    seconds = time.monotonic() - t_lat
    sampler_stop.set()
    await sampler
    if opts.kill_tracker_at is not None:
        await killer
    lat_usage = usage.stop()
    figures = {
        "seconds": round(seconds, 1),
        "usage": lat_usage,
        "bus": _rates(v0, varz(server), seconds),
        "route_ms": percentiles([r.latency for r in probe.routes if r.latency is not None and r.attempts == 1]),
        "coverage_ms": percentiles([c.latency for c in probe.coverages if c.latency is not None]),
        "coverage_age_ms": percentiles([c.age for c in probe.coverages if c.age is not None]),
        "coverage_bytes": max((c.size for c in probe.coverages), default=0),
        "coverage_live_nodes": [c.live for c in probe.coverages if c.latency is not None][-1:],
        "coverage_errors": [c.error for c in probe.coverages if c.error][:3],
    }
    return figures, killed.get("at")


async def _kill_figures(nc, probe: P.Probe, opts: Options, killed_at: float) -> dict:
    """How the route requests fared after tracker 0 was killed, and whether its routes survived."""
    after = [r for r in probe.routes if r.sent >= killed_at]
    before = [r.reply for r in probe.routes if r.sent < killed_at and isinstance(r.reply, M.RouteAssignment)]
    return {
        "killed_at_s": opts.kill_tracker_at,
        "requests_after": len(after),
        "answered_after": sum(r.reply is not None for r in after),
        "unanswered_after": sum(r.reply is None for r in after),
        "answered_on_retry": sum(r.reply is not None and r.attempts > 1 for r in probe.routes),
        "routes_before": len(before),
        "routes_before_lost": await _lost(nc, before),
    }


async def _throughput_phase(
    opts: Options, server: NatsServer, pids: dict[str, int], probe: P.Probe, idle: dict
) -> dict:
    """``opts.concurrency`` clients asking back to back; ``idle``: the idle phase's usage, so that
    the trackers' CPU a route costs is what they spend beyond heartbeats and pings."""
    usage, v0 = Usage(pids), varz(server)
    usage.start()
    answered, secs, lats = await probe.closed_loop(opts.concurrency, opts.throughput_seconds)
    tp_usage = usage.stop()
    trackers_now = [k for k in tp_usage if k.startswith("tracker-")]
    extra_cpu = sum(tp_usage[k]["cpu_share"] - idle[k]["cpu_share"] for k in trackers_now) * secs
    return {
        "concurrency": opts.concurrency,
        "routes_per_s": round(answered / secs, 1),
        "route_ms": percentiles(lats),
        # tracker CPU a route costs beyond heartbeats and pings (all trackers together):
        # flat from one tracker to three means throughput grows with the cores they get
        "tracker_cpu_ms_per_route": round(extra_cpu / max(answered, 1) * 1000, 3),
        "usage": tp_usage,
        "bus": _rates(v0, varz(server), secs),
    }


def _stop_pool(pool: Proc) -> tuple[dict, dict]:
    """Stop the node pool and read what it reported: (node id -> its gone record, its stats)."""
    pool.stop()
    gone, stats = {}, {}
    while True:
        line = pool.lines.get(timeout=30)
        if line is None:
            break
        record = json.loads(line)
        if "gone" in record:
            gone[record["gone"]] = record
        elif "stats" in record:
            stats = record["stats"]
    return gone, stats


async def _simulate(opts: Options, workdir: Path) -> dict:
    server = start_server(workdir)
    trackers: list[Proc] = []
    pool: Proc | None = None
    try:
        nc = await connect(server.url, name="swarm-sim-clients")
        await ensure_topology(nc.jetstream())
        trackers = _start_trackers(opts, server.url, workdir)
        spec = _swarm_spec(opts)
        nodes = swarm.generate(spec)
        t0 = time.time()
        pool = _start_pool(opts, server.url, spec, t0, workdir)
        ready = json.loads(pool.wait_line(lambda line: line.startswith('{"ready"'), 300))
        ready_at = time.time()
        maps_nc = await connect(server.url, name="swarm-sim-maps")
        probe = P.Probe(
            nc,
            timeout=opts.timeout,
            sample_every=max(1, int(opts.route_rate * opts.duration / max(opts.quality_samples, 1))),
            maps_nc=maps_nc,
        )
        await _warm(nc, probe, opts, ready_at)

        assert server.pid is not None, "start_server() returns a running server"
        pids = {f"tracker-{i}": t.pid for i, t in enumerate(trackers)}
        pids |= {"nats-server": server.pid, "node-pool": pool.pid}
        result: dict = {
            "options": asdict(opts),
            "nodes_announced": ready["ready"],
            "announce_seconds": round(ready_at - t0, 2),
        }
        result["idle"] = await _idle_phase(opts, server, pids)
        result["latency_phase"], killed_at = await _latency_phase(opts, server, pids, probe, trackers)
        if killed_at is not None:
            result["kill"] = await _kill_figures(nc, probe, opts, killed_at)
        if opts.throughput_seconds > 0:
            alive = {k: v for k, v in pids.items() if not (killed_at is not None and k == "tracker-0")}
            result["throughput_phase"] = await _throughput_phase(opts, server, alive, probe, result["idle"]["usage"])

        gone, stats = _stop_pool(pool)
        result["pool"] = stats | {"gone": len(gone)}
        truth = {n.node_id: n for n in nodes}
        params = TrackerParams(expiry=opts.expiry)
        result["checks"] = _checks(probe.routes, truth, gone, opts.expiry)
        result["quality"] = _quality(probe.routes, Judge(nodes, params), t0, opts.quality_samples)
        await maps_nc.close()
        await nc.close()
        return result
    finally:
        if pool is not None:
            pool.stop()
        for t in trackers:
            t.stop()
        server.stop()


def simulate(opts: Options, workdir: Path | None = None) -> dict:
    """Run one simulation; every process it started is stopped when it returns or fails."""
    if workdir is not None:
        return asyncio.run(_simulate(opts, Path(workdir)))
    with tempfile.TemporaryDirectory(prefix="swarm-sim-") as tmp:
        return asyncio.run(_simulate(opts, Path(tmp)))


def _children(usage: dict) -> str:
    """`` (children 0.07)`` when the process's reaped children took CPU (forked map builds)."""
    share = usage.get("children_cpu_share", 0.0)
    return f" (children {share:.2f})" if share else ""


def summary(result: dict) -> str:
    lat = result["latency_phase"]
    lines = [
        f"nodes {result['options']['nodes']}, trackers {result['options']['trackers']}",
        f"route ms {lat['route_ms']}",
        f"coverage ms {lat['coverage_ms']} ({lat['coverage_bytes']} bytes), map age ms {lat['coverage_age_ms']}",
    ]
    if "throughput_phase" in result:
        tp = result["throughput_phase"]
        lines.append(
            f"throughput {tp['routes_per_s']} routes/s at {tp['concurrency']} clients, ms {tp['route_ms']},"
            f" tracker CPU {tp['tracker_cpu_ms_per_route']} ms a route"
        )
    for phase in ("idle", "latency_phase"):
        u = result[phase]["usage"]
        lines.append(
            f"{phase}: "
            + ", ".join(f"{k} cpu {v['cpu_share']:.2f}{_children(v)} rss {v['rss_mb']} MB" for k, v in u.items())
        )
        lines.append(f"{phase} bus: {result[phase]['bus']}")
    lines.append(f"quality {result['quality']}")
    lines.append(f"checks {result['checks']}")
    if "kill" in result:
        lines.append(f"kill {result['kill']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    d = Options()
    p = argparse.ArgumentParser(prog="scripts/swarm_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=d.nodes)
    p.add_argument("--trackers", type=int, default=d.trackers)
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of the latency phase")
    p.add_argument(
        "--churn", default=d.churn, help='per minute: "0.01" (each kind) or "joins=0.02,leaves=0,deaths=0.01"'
    )
    p.add_argument("--route-rate", type=float, default=d.route_rate)
    p.add_argument("--coverage-rate", type=float, default=d.coverage_rate)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--throughput-seconds", type=float, default=d.throughput_seconds)
    p.add_argument("--idle-seconds", type=float, default=d.idle_seconds)
    p.add_argument("--kill-tracker-at", type=float, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--expiry", type=float, default=d.expiry)
    p.add_argument("--warmup", type=float, default=d.warmup, help="seconds (default: pings reach every node once)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--tracker-arg", action="append", default=[], help="extra argument for every tracker")
    p.add_argument("--tracker-pythonpath", default=None, help="run the tracker of this checkout (compare versions)")
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds a route request waits")
    p.add_argument("--profile", default=None, help="directory for each tracker's cProfile stats")
    a = p.parse_args(argv)
    opts = Options(
        nodes=a.nodes,
        trackers=a.trackers,
        duration=a.duration,
        churn=a.churn,
        route_rate=a.route_rate,
        coverage_rate=a.coverage_rate,
        concurrency=a.concurrency,
        throughput_seconds=a.throughput_seconds,
        idle_seconds=a.idle_seconds,
        kill_tracker_at=a.kill_tracker_at,
        seed=a.seed,
        expiry=a.expiry,
        warmup=a.warmup,
        tracker_args=tuple(a.tracker_arg),
        profile_dir=a.profile,
        timeout=a.timeout,
        tracker_pythonpath=a.tracker_pythonpath,
    )
    try:
        result = simulate(opts)
    except SimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    print(summary(result))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
        print(f"figures written to {a.json}")
