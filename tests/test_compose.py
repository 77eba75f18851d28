"""compose.yaml is not run here (no Docker engine); this test checks its shape instead."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from neuron_bus.cli import app

ROOT = Path(__file__).resolve().parent.parent
compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
services = compose["services"]


def argv(name: str) -> list[str]:
    cmd = services[name]["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else cmd


def opt(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_three_jetstream_servers_form_one_cluster():
    nats = sorted(n for n in services if n.startswith("nats-"))
    assert nats == ["nats-1", "nats-2", "nats-3"]
    names = set()
    for n in nats:
        args = argv(n)
        assert args[:2] == ["neuron-bus", "server"]
        assert opt(args, "--cluster-name") == "neuron"
        assert opt(args, "--replicas") == "3"
        names.add(opt(args, "--server-name"))
        routes = opt(args, "--routes").split(",")
        port = opt(args, "--cluster-port")
        # every server routes to all three cluster members on the cluster port
        assert sorted(routes) == sorted(f"nats-route://{m}:{port}" for m in nats)
    assert names == set(nats)


def test_tracker_gateway_and_two_workers_covering_all_layers():
    assert argv("tracker")[:2] == ["neuron-bus", "tracker"]
    gw = argv("gateway")
    assert gw[:2] == ["neuron-bus", "gateway"]
    assert f"{opt(gw, '--port')}:{opt(gw, '--port')}" in services["gateway"]["ports"]
    workers = [n for n in services if argv(n)[1] == "worker"]
    assert len(workers) >= 2
    covered = set()
    for w in workers:
        a, b = map(int, opt(argv(w), "--layers").split("-"))
        covered |= set(range(a, b + 1))
    assert covered == set(range(30))  # SmolLM2-135M has 30 layers


def test_every_service_points_at_the_cluster():
    url = compose["x-neuron"]["environment"]["NEURON_NATS_URL"]
    assert sorted(re.findall(r"nats://(nats-\d):4222", url)) == ["nats-1", "nats-2", "nats-3"]
    for name, svc in services.items():
        assert svc["environment"]["NEURON_NATS_URL"] == url, name


def test_every_command_is_a_real_subcommand():
    import typer.main

    group = typer.main.get_command(app)
    for name in services:
        args = argv(name)
        assert args[0] == "neuron-bus"
        assert args[1] in group.commands, f"{name}: unknown subcommand {args[1]}"
        sub = group.commands[args[1]]
        known = {o for p in sub.params for o in p.opts + p.secondary_opts}
        for token in args[2:]:
            if token.startswith("--"):
                assert token in known, f"{name}: {args[1]} has no option {token}"
