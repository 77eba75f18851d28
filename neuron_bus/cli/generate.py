"""`neuron-bus generate` and `neuron-bus sessions`: a client of a running bus."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import cast

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from neuron_bus import messages as M
from neuron_bus.cli.app import NatsOption, app, fail
from neuron_bus.client import NeuronClient, Prepared, RouteError
from neuron_bus.models import DEFAULT_PRESET


class GenerationBar:
    """The progress bar on stderr: prefill progress, then tokens and rolling tok/s."""

    def __init__(self, console: Console, prompt_tokens: int, max_tokens: int, disable: bool):
        self.max_tokens = max_tokens
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=disable,
        )
        self.task = self.progress.add_task("prefill", total=prompt_tokens, rate="")

    def telemetry(self, ev: M.GenerationTelemetry) -> None:
        waiting = f" (waiting its turn at {', '.join(ev.waiting_at)})" if ev.waiting_at else ""
        if ev.phase == "prefill":
            self.progress.update(self.task, completed=ev.prefill_tokens_done, description="prefill" + waiting)
        elif ev.phase == "decode":
            rate = f"{ev.rolling_tokens_per_second:.1f} tok/s"
            self.progress.update(self.task, completed=ev.generated_tokens, total=self.max_tokens, rate=rate)
            self.progress.update(self.task, description="decode" + waiting)

    def token(self, generated: int) -> None:
        self.progress.update(self.task, completed=generated, total=self.max_tokens, description="decode")

    def __enter__(self) -> GenerationBar:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()


async def run_generation(
    url: str,
    prompt: str,
    *,
    chat: bool,
    sampling: M.SamplingParams,
    model: str,
    wire_dtype: M.WireDtype,
    encoding: M.Encoding,
    chunk_size: int,
    as_json: bool,
    out=sys.stdout,
    policy: str = "public",
    speculative: int = 0,
    encrypt_activations: bool | None = None,
) -> dict:
    """Stream one generation: text to ``out``, a progress bar and tok/s to stderr."""
    err = Console(stderr=True)
    started = time.monotonic()
    deltas: list[M.TokenDelta] = []
    first = None
    async with await NeuronClient.connect(url, encrypt_activations=encrypt_activations) as client:
        text = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        p = await client.prepare(model, **text, policy=policy, wire_dtype=wire_dtype, encoding=encoding)
        routes = [p.route]  # then a retry's or a repair's: the last is the one the tokens came from
        with GenerationBar(err, len(p.prompt_tokens), sampling.max_tokens, as_json or not err.is_terminal) as bar:
            gen = client.generate(
                prompt_tokens=p.prompt_tokens,
                route=p.route,
                sampling=sampling,
                model_preset=model,
                chunk_size=chunk_size,
                policy=policy,
                speculative=speculative,
                on_route=routes.append,
            )
            async for ev in gen:
                if isinstance(ev, M.GenerationTelemetry):
                    bar.telemetry(ev)
                    continue
                first = first or time.monotonic()
                deltas.append(ev)
                if not as_json:
                    out.write(ev.text)
                    out.flush()
                bar.token(len(deltas))
    elapsed = time.monotonic() - started
    rate = (len(deltas) - 1) / (time.monotonic() - first) if first and len(deltas) > 1 else 0.0
    return report(Prepared(routes[-1], p.prompt_tokens), deltas, rate, elapsed, as_json, out, err)


def report(
    p: Prepared, deltas: list[M.TokenDelta], rate: float, elapsed: float, as_json: bool, out, err: Console
) -> dict:
    route = p.route
    result = {
        "route_id": route.route_id,
        "nodes": [h.node_id for h in route.hops],
        "policy": route.policy,
        "session_id": deltas[0].session_id if deltas else None,
        "trust_tiers": [h.trust_tier for h in route.hops],
        "prompt_tokens": p.prompt_tokens,
        "tokens": [d.token_id for d in deltas],
        "text": "".join(d.text for d in deltas),
        "finish_reason": deltas[-1].finish_reason if deltas else None,
        "decode_tokens_per_second": round(rate, 2),
        "elapsed_s": round(elapsed, 3),
    }
    if as_json:
        out.write(json.dumps(result) + "\n")
    else:
        out.write("\n")
        err.print(
            f"[dim]{len(deltas)} tokens, {rate:.1f} tok/s, route {' -> '.join(h.node_id for h in route.hops)}, "
            f"finish: {result['finish_reason']}[/dim]"
        )
    return result


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt."),
    nats: str = NatsOption,
    max_tokens: int = typer.Option(64, min=1, max=32768, help="Tokens to generate at most."),
    wire_dtype: str = typer.Option("f32", help="Activation dtype between hops: f32 | bf16."),
    zstd: bool = typer.Option(False, help="Compress activations with zstd level 1."),
    chunk_size: int = typer.Option(256, min=1, help="Prefill chunk size in tokens."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(0),
    stop: list[str] = typer.Option([], help="Stop strings (repeatable)."),
    model: str = typer.Option(DEFAULT_PRESET, help="Model preset to route for."),
    chat: bool = typer.Option(False, help="Wrap the prompt in the model's chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print token ids and text as JSON."),
    policy: str = typer.Option("public", help="Route policy: public | private (trusted nodes only) | paid-trusted."),
    encrypt_activations: bool = typer.Option(
        False, "--encrypt-activations", help="Seal activation bodies and snapshots (AEAD) besides their MACs."
    ),
    speculative: int = typer.Option(
        0,
        min=0,
        max=M.MAX_SPECULATIVE,
        help="Speculative ring steps: up to this many draft tokens per decode step (same output; 0: off).",
    ),
) -> None:
    """Stream a generation from a running bus."""
    if wire_dtype not in ("f32", "bf16"):
        fail("--wire-dtype must be f32 or bf16")
    if policy not in ("public", "private", "paid-trusted"):
        fail("--policy must be public, private or paid-trusted")
    sampling = M.SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens, stop=stop
    )
    try:
        asyncio.run(
            run_generation(
                nats,
                prompt,
                chat=chat,
                sampling=sampling,
                model=model,
                wire_dtype=cast(M.WireDtype, wire_dtype),
                encoding="zstd" if zstd else "raw",
                chunk_size=chunk_size,
                as_json=as_json,
                policy=policy,
                speculative=speculative,
                encrypt_activations=encrypt_activations or None,
            )
        )
    except RouteError as exc:
        where = f" at node {exc.node_id}" if exc.node_id else ""
        fail(f"generation failed in phase {exc.phase}{where}: {exc.reason}: {exc}")
    except OSError as exc:
        fail(f"cannot reach the bus at {nats}: {exc}")


@app.command()
def sessions(
    node: str = typer.Argument(..., help="Node id."),
    nats: str = NatsOption,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """A node's active sessions and cache bytes by session."""

    async def query():
        async with await NeuronClient.connect(nats) as client:
            return await client.sessions(node)

    try:
        report = asyncio.run(query())
    except RouteError as exc:
        fail(str(exc))
    if as_json:
        typer.echo(M.encode(report).decode())
        return
    table = Table(title=f"{report.node_id}: {len(report.sessions)} sessions, {report.cache_bytes_total} cache bytes")
    for col in ("session", "route", "hop", "position", "cache bytes", "idle s"):
        table.add_column(col)
    for s in report.sessions:
        table.add_row(
            s.session_id, s.route_id, str(s.hop_index), str(s.position), str(s.cache_bytes), f"{s.idle_seconds:.1f}"
        )
    Console().print(table)
