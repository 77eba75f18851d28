"""What `scripts/bench --record` keeps of a bench invocation: docs/bench.json and the README's table.

Every figure of the invocation's runs is summarized as its median with the lowest and highest run
(a user reproduces a range, not the best run); the README's table between the ``bench:begin`` and
``bench:end`` markers is rewritten from that summary, with the commit and date it was measured at.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JSON = ROOT / "docs" / "bench.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def spread(values: list):
    """Median/min/max of numbers, element-wise through dicts; other values from the last run."""
    first = values[-1]
    if isinstance(first, dict):
        return {k: spread([v[k] for v in values if k in v]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool) and len(values) > 1:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return first


def median(figure) -> float:
    return figure["median"] if isinstance(figure, dict) and "median" in figure else figure


def _range(figure, fmt: str) -> str:
    if isinstance(figure, dict) and "median" in figure:
        return f"{format(figure['median'], fmt)} ({format(figure['min'], fmt)}–{format(figure['max'], fmt)})"
    return format(figure, fmt)


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        )
        return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def summarize(runs: list[dict], quick: bool) -> dict:
    """The figures of every run (``runs``) and, beside them, each figure's median and range."""
    runs = json.loads(json.dumps(runs))  # as the file will hold them (keys become strings)
    return {
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "quick": quick,
        "n_runs": len(runs),
        "summary": spread(runs),
        "runs": runs,
    }


ROWS = (  # README row: (label, decode figure, prefill-4096 figure or None)
    ("single-process llama.cpp", "single_decode_tok_s", "single_prefill_tok_s"),
    ("2-hop route (llama.cpp)", "route2_decode_tok_s", "route2_prefill_tok_s"),
    ("3-hop route (llama.cpp)", "route3_decode_tok_s", "route3_prefill_tok_s"),
    ("2-hop route (torch fp32)", "route2_torch_decode_tok_s", None),
)


def table(result: dict) -> str:
    s, big = result["summary"], "4096"
    single_decode, single_prefill = median(s["single_decode_tok_s"]), median(s["single_prefill_tok_s"][big])
    lines = [
        "| contender | decode tok/s | vs single | prefill 4096 tok/s | vs single |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for label, decode, prefill in ROWS:
        row = f"| {label} | {_range(s[decode], '.1f')} | {median(s[decode]) / single_decode:.2f} |"
        if prefill:
            row += f" {_range(s[prefill][big], '.1f')} | {median(s[prefill][big]) / single_prefill:.2f} |"
        else:
            row += " – | – |"
        lines.append(row)
    agg8 = s["aggregate_decode_tok_s"]["8"]
    lines.append(
        f"| 2-hop route, 8 sessions (aggregate) | {_range(agg8, '.1f')} | {median(agg8) / single_decode:.2f} | – | – |"
    )
    n = result["n_runs"]
    lines += [
        "",
        f"Medians of {n} run{'s' * (n > 1)} (lowest–highest in brackets) of `scripts/bench"
        f"{' --quick' if result['quick'] else ''} --runs {n} --record`, commit {result['commit']}, {result['date']}.",
        f"2-hop decode against the single process: {_range(s['route2_vs_single_decode_ratio'], '.2f')}× measured "
        f"back to back, {_range(s['route2_vs_single_decode_ratio_paired_median'], '.2f')}× measured alternately "
        "(single, route, single, … seconds apart; docs/bench.md says why the two differ). "
        f"8 sessions vs one: {_range(s['concurrent8_vs_single_ratio'], '.2f')}×. "
        f"Per-hop overhead (no-op hops) p50 {_range(s['per_hop_overhead_ms_p50'], '.2f')} ms, against "
        f"{_range(s['jetstream_relay_floor_ms_p50'], '.2f')} ms for a bare two-process JetStream relay"
        + (f" ({_range(s['noop_hop_vs_relay_floor'], '.2f')}×)" if "noop_hop_vs_relay_floor" in s else "")
        + (
            f"; CPU per hop and token {_range(s['noop_hop_cpu_ms_per_token'], '.2f')} ms against the relay's "
            f"{_range(s['jetstream_relay_floor_cpu_ms_per_leg'], '.2f')} ms per message "
            f"({_range(s['noop_hop_cpu_vs_relay_floor'], '.2f')}×)."
            if "noop_hop_cpu_vs_relay_floor" in s
            else "."
        ),
    ]
    return "\n".join(lines)


def write_readme(result: dict, readme: Path = README) -> None:
    text = readme.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    readme.write_text(text[:start] + "\n" + table(result) + "\n" + text[end:])
