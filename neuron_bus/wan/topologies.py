"""Two WAN topologies on this machine, as real processes (LocalSwarm underneath), wired through the
link emulator (linkem.py, in its own process):

- ``StarSwarm``: one nats-server; every worker, the tracker (and any gateway or client asked for
  with ``link_url``) reaches it through its own emulated link: a ring of H hops crosses 2H links
  per token (into the server and out of it at every seam).
- ``RegionSwarm``: one nats-server per region, the regions joined into a NATS supercluster by
  gateways; each region's gateway is reached only through that region's emulated WAN link, so
  every crossing between two regions pays the link's one-way delay. Workers and clients attach to
  their region's server directly (the LAN). Streams and buckets are R1, placed in the home region
  (the cluster the topology is provisioned from); docs/wan.md says why this shape and what each
  placement costs per token.

The emulator's control API (``swarm.emulator``) reshapes or partitions any link while traffic flows.
"""

from __future__ import annotations

from pathlib import Path

from neuron_bus.local_swarm import LocalSwarm
from neuron_bus.natsserver import NatsServer, ServerConfig, free_port
from neuron_bus.wan.linkem import EmulatorProcess, Shape


class _Emulated(LocalSwarm):
    """A LocalSwarm whose links live in one emulator process, started with the swarm."""

    emulator: EmulatorProcess | None = None

    @property
    def links(self) -> EmulatorProcess:
        assert self.emulator is not None, "the swarm's links exist once it has started"
        return self.emulator

    def _start_emulator(self) -> EmulatorProcess:
        if self.emulator is None:
            self.emulator = EmulatorProcess(log_path=self.workdir / "linkem.log")
            self._add_links()
        return self.emulator

    def _add_links(self) -> None:
        """Links that must exist before the servers start."""

    def start(self, timeout: float = 180.0, on_step=None):
        self._start_emulator()
        try:
            return super().start(timeout, on_step)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        super().stop()
        if self.emulator is not None:
            self.emulator.close()
            self.emulator = None

    def shape_all(self, names: list[str] | None = None, **shape) -> None:
        """Give every link (or ``names``) the same shape in both directions (Shape's keywords)."""
        for name in names or [s.name for s in self.links.stats()]:
            self.links.shape(name, **shape)


class StarSwarm(_Emulated):
    """One nats-server; each process behind its own link of ``delay_ms`` one way (both directions)."""

    def __init__(self, model_path: Path, shards: int = 2, *, delay_ms: float = 0.0, **kw):
        if kw.get("cluster", 1) != 1:
            raise ValueError("a star has one nats-server")
        self.delay_ms = delay_ms
        super().__init__(model_path, shards, **kw)

    def link_url(self, name: str, role: str = "admin") -> str:
        """The bus through link ``name``, created on first use (with the swarm's delay)."""
        em = self._start_emulator()
        if not any(s.name == name for s in em.stats()):
            em.add_link(name, self.servers[0].config.port, delay_ms=self.delay_ms)
        url = em.url(name)
        if not self.credentials:
            return url
        from neuron_bus.trust.permissions import role_url

        return role_url(url, role, self.credentials[role])

    def process_url(self, name: str, role: str) -> str:
        return self.link_url(name, role)


# Every client lands in the NEURON account without credentials; the system account (for
# supercluster operations such as moving the JetStream meta leader) takes SYSTEM_USER.
SYSTEM_USER = ("sys", "sys")
ACCOUNTS = f"""accounts {{
  SYS {{ users: [ {{ user: "{SYSTEM_USER[0]}", password: "{SYSTEM_USER[1]}" }} ] }}
  NEURON {{ jetstream: enabled, users: [ {{ user: "neuron", password: "neuron" }} ] }}
}}
system_account: SYS
no_auth_user: neuron"""


class RegionSwarm(_Emulated):
    """One nats-server per region, joined by gateways over emulated WAN links.

    ``worker_regions[i]`` is the region of worker i; the tracker (and a gateway) run in ``home``,
    which also holds every stream and bucket. A crossing between two regions costs ``delay_ms``
    one way: region X's link carries every gateway connection into X, and its ``down`` direction
    the protocol traffic back on those connections.
    """

    def __init__(
        self,
        model_path: Path,
        shards: int = 2,
        *,
        regions: tuple[str, ...] = ("a", "b", "c"),
        worker_regions: list[str] | None = None,
        home: str | None = None,
        delay_ms: float = 0.0,
        **kw,
    ):
        if len(regions) < 2 or len(set(regions)) != len(regions):
            raise ValueError("regions must be at least two distinct names")
        if kw.get("credentials"):
            raise ValueError("RegionSwarm runs without credentials")
        self.regions = tuple(regions)
        self.home = home or regions[0]
        self.delay_ms = delay_ms
        self.wan_port = {r: free_port() for r in regions}  # each region's emulated WAN link
        self.nats_gateway_port = {r: free_port() for r in regions}  # (gateway_port is the HTTP gateway)
        super().__init__(model_path, shards, **kw)
        self.replicas = 1  # a stream lives in one cluster of a supercluster
        wr = worker_regions or [regions[i % len(regions)] for i in range(len(self.workers))]
        if len(wr) != len(self.workers) or not set(wr) <= set(regions):
            raise ValueError(
                f"worker_regions {wr} must name a region of {regions} for each of {len(self.workers)} workers"
            )
        self.worker_region = {spec.node_id: r for spec, r in zip(self.workers, wr)}

    def _make_servers(self, cluster: int, nats_port: int | None, http_port: int | None, auth: str) -> list[NatsServer]:
        servers = []
        for r in self.regions:
            route = free_port()
            servers.append(
                NatsServer(
                    ServerConfig(
                        store_dir=self.workdir / f"nats-{r}",
                        port=free_port(),
                        http_port=free_port(),
                        server_name=f"nats-{r}",
                        cluster_name=r,
                        # a one-server cluster: JetStream clustering (the supercluster's meta group)
                        # wants configured routes; a route to itself is ignored
                        cluster_port=route,
                        routes=[f"nats-route://127.0.0.1:{route}"],
                        gateway_port=self.nats_gateway_port[r],
                        # every server learns only the WAN link's address of this gateway, so that
                        # gossip never lets a reconnecting gateway bypass the link
                        gateway_advertise=f"127.0.0.1:{self.wan_port[r]}",
                        gateways={o: [f"nats://127.0.0.1:{self.wan_port[o]}"] for o in self.regions if o != r},
                        extra=ACCOUNTS,
                    )
                )
            )
        return servers

    def _add_links(self) -> None:
        for r in self.regions:
            self.links.add_link(r, self.nats_gateway_port[r], port=self.wan_port[r], delay_ms=self.delay_ms)

    def server(self, region: str) -> NatsServer:
        return self.servers[self.regions.index(region)]

    def region_url(self, region: str) -> str:
        """The bus of ``region``: a client there connects to its own server."""
        return self.server(region).url

    @property
    def plain_url(self) -> str:
        return self.region_url(self.home)

    def process_url(self, name: str, role: str) -> str:
        return self.region_url(self.worker_region.get(name, self.home))

    def system_url(self, region: str) -> str:
        """``region``'s server as the system account (meta leader moves, server reports)."""
        user, password = SYSTEM_USER
        return self.region_url(region).replace("nats://", f"nats://{user}:{password}@")

    def meta_leader(self) -> str | None:
        """The server leading the supercluster's JetStream meta group (from the home server's /jsz)."""
        return (self.server(self.home).monitor("jsz").get("meta_cluster") or {}).get("leader")

    def wan_shape(self, region: str, shape: Shape) -> None:
        """Reshape the WAN link into ``region`` (both directions)."""
        self.links.shape(region, up=shape, down=shape)

    def lose_region(self, region: str) -> None:
        """The region goes dark: its WAN link is cut, its server and its workers die."""
        if region == self.home:
            raise ValueError("the home region holds the streams: losing it loses the bus")
        self.links.partition(region, "cut")
        for node, r in self.worker_region.items():
            if r == region:
                self.kill(node)
        self.server(region).stop()


def stretched_cluster(emulator, workdir: Path, regions: tuple[str, ...], delay_ms: float) -> list[NatsServer]:
    """The alternative docs/wan.md rejects, for measuring it: one NATS cluster stretched over the
    regions (a server per region, routes over each region's emulated WAN link), unstarted. Every
    route connection into a region passes its link; each server advertises its link's address so
    that route gossip cannot bypass it."""
    route = {r: free_port() for r in regions}
    wan = {r: emulator.add_link(f"route-{r}", route[r], delay_ms=delay_ms) for r in regions}
    return [
        NatsServer(
            ServerConfig(
                store_dir=workdir / f"stretched-{r}",
                port=free_port(),
                http_port=free_port(),
                server_name=f"nats-{r}",
                cluster_name="stretched",
                cluster_port=route[r],
                cluster_advertise=f"127.0.0.1:{wan[r]}",
                routes=[f"nats-route://127.0.0.1:{wan[o]}" for o in regions if o != r],
            )
        )
        for r in regions
    ]
