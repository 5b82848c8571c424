"""`rollstream bench rollout`: what the agent loop costs beside the engine alone, against one real engine.

Phase 1 (loop): `--trajectories` agent loops on a fixed mix (calc and db dev samples, alternating),
`--concurrency` at a time, each with its own environment session, through the env worker's engine
pool and `run_agent_loop` (as `rollstream env-worker` runs them, without Kafka: publishing is not
timed). Generated tokens and finished trajectories over wall time.

Phase 2 (engine alone): the same engine generates the same token counts: one request per turn of
phase 1, with a prompt of that turn's length and max_tokens = the tokens that turn generated
(ignore_eos, no stop tokens, so each request yields exactly that many), at the same temperature
and concurrency, with no environment in between. The prompts are phase 1's own with the first token
replaced, so the prefix cache phase 1 warmed does not serve them, while they share prefixes among
themselves as the loop's prompts do.

`ratio` = loop tokens/s / engine-alone tokens/s (1.0: the loop costs nothing). Weight-update
time is left out (measured elsewhere) and the output says so.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from env_workers.chat_template import ChatEncoder
from env_workers.engine_client import completion_request, parse_completion
from env_workers.envs import registry
from env_workers.settings import AgentLoopSettings
from pipeline.env_cmd import env_settings
from pipeline.env_worker_cmd import served_model
from pipeline.model_init import PolicyModelSettings, init_model
from pipeline.sft import eval_task, roll_out, serving
from schemas.arrays import unpack_ids

MIX = (("calc", "dev"), ("db", "dev"))
LEFT_OUT = "weight-update time (measured elsewhere); Kafka publishing of steps and trajectories"

app = typer.Typer(help="Agent-loop throughput beside the engine alone.")


def turn_requests(trajectories: Sequence[dict[str, Any]], replacement: int) -> list[tuple[list[int], int]]:
    """(prompt ids, generated count) of every turn, the prompt's first token replaced (see the module docstring)."""
    requests = []
    for trajectory in trajectories:
        ids = unpack_ids(trajectory["input_ids"]).tolist()
        for turn in trajectory["turns"]:
            prompt = ids[:turn["start"]]
            requests.append(([replacement if prompt[0] != replacement else replacement + 1, *prompt[1:]], turn["length"]))
    return requests


async def engine_alone(url: str, model: str, requests: Sequence[tuple[list[int], int]], temperature: float,
                       concurrency: int) -> tuple[int, float]:
    """(tokens generated, wall seconds) for `requests`, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=600.0) as http:

        async def one(prompt: list[int], count: int) -> int:
            body = completion_request(model, prompt, count, temperature, []) | {"ignore_eos": True}
            async with gate:
                response = await http.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            return len(parse_completion(response.json(), "bench")[0])

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(prompt, count) for prompt, count in requests))
        return sum(counts), time.perf_counter() - started


def _row(name: str, trajectories: int, turns: int, tokens: int, seconds: float) -> dict[str, Any]:
    return {"name": name, "trajectories": trajectories, "turns": turns, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": tokens / seconds, "trajectories_per_s": trajectories / seconds}


def bench_rollout(
    model: Path | None = typer.Option(None, "--model", help="Checkpoint to serve (default: a fresh `model init`)."),
    trajectories: int = typer.Option(16, "--trajectories", help="Agent loops in phase 1 (calc and db alternating)."),
    concurrency: int = typer.Option(16, "--concurrency", help="Loops (and requests) in flight."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Tokens per turn."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Tokens/s and trajectories/s of agent loops against one engine, beside the engine alone generating
    the same token counts; `ratio` = loop tokens/s / engine-alone tokens/s.

    Example: rollstream bench rollout --model .run/policy-sft --json
    """
    if trajectories < 1 or concurrency < 1 or max_new_tokens < 1:
        typer.echo("rollstream bench rollout: --trajectories, --concurrency and --max-new-tokens must be positive",
                   err=True)
        raise typer.Exit(code=2)
    if model is not None and not (model / "config.json").is_file():
        typer.echo(f"rollstream bench rollout: {model} is not a checkpoint directory (no config.json)", err=True)
        raise typer.Exit(code=2)
    envs = env_settings()
    loop = AgentLoopSettings(max_new_tokens=max_new_tokens)
    err = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-rollout-") as work:
        if model is None:
            model = Path(work) / "policy"
            init_model(PolicyModelSettings(), model)
            err.print("serving a fresh, untrained `model init` policy (pass --model for a fine-tuned one)")
        encoder = ChatEncoder(AutoTokenizer.from_pretrained(model))
        tasks = [eval_task("bench-rollout", *MIX[i % len(MIX)], i // len(MIX)) for i in range(trajectories)]
        for task in tasks:  # resolve every sample before timing (loading a split is not the loop's cost)
            registry.sample(task["request"]["task"], task["request"]["split"], task["request"]["sample_index"], envs)
        with serving(model, Path(work) / "engines", loop.max_total_len, 600.0) as engine:
            name = served_model(engine.url)
            err.print(f"engine serving {model}; phase 1: {trajectories} agent loops, {concurrency} at a time")
            started = time.perf_counter()
            rollouts = asyncio.run(roll_out(engine.url, name, encoder, tasks, loop, envs, concurrency))
            loop_s = time.perf_counter() - started
            done = [r.trajectory for r in rollouts]
            requests = turn_requests(done, encoder.eos_token_id)
            err.print(f"phase 2: the engine alone, {len(requests)} requests of the same lengths")
            alone_tokens, alone_s = asyncio.run(engine_alone(engine.url, name, requests, loop.temperature, concurrency))
    loop_tokens = sum(turn["length"] for t in done for turn in t["turns"])
    loop_row = _row("agent loop + environments", len(done), len(requests), loop_tokens, loop_s)
    alone_row = _row("engine alone", len(done), len(requests), alone_tokens, alone_s)
    statuses: dict[str, int] = {}
    for t in done:
        statuses[t["status"]] = statuses.get(t["status"], 0) + 1
    report = {"model": str(model), "mix": [f"{f}/{s}" for f, s in MIX], "concurrency": concurrency,
              "max_new_tokens": max_new_tokens, "temperature": loop.temperature, "loop": loop_row,
              "engine_alone": alone_row, "ratio": loop_row["tokens_per_s"] / alone_row["tokens_per_s"],
              "statuses": statuses, "left_out": LEFT_OUT}
    if as_json:
        typer.echo(json.dumps(report))
        return
    table = Table(title=f"rollout throughput (calc + db, concurrency {concurrency}, temperature {loop.temperature})")
    for column in ("phase", "trajectories", "turns", "tokens", "seconds", "tokens/s", "trajectories/s"):
        table.add_column(column)
    for row in (loop_row, alone_row):
        table.add_row(row["name"], str(row["trajectories"]), str(row["turns"]), str(row["tokens"]),
                      f"{row['seconds']:.2f}", f"{row['tokens_per_s']:.0f}", f"{row['trajectories_per_s']:.2f}")
    console = Console()
    console.print(table)
    console.print(f"ratio (loop tokens/s / engine-alone tokens/s): {report['ratio']:.3f}; statuses {statuses}")
    console.print(f"left out: {LEFT_OUT}")


app.command("rollout")(bench_rollout)
