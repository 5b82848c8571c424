"""`rollstream bench precision`: float32 against bfloat16 on this machine, for the engines and the learner.

Engines: two real engines (`rollstream engine --dtype float32` and `--dtype bfloat16`) serve the same
checkpoint, started together and measured one after the other with the other idle: the same
`--requests` completions (the first-turn prompts of calc and db held-out samples, as the agent loop
encodes them; `--max-new-tokens` each with ignore_eos; the agent loop's temperature; a fixed seed per
request), `--concurrency` at a time; tokens/s from the wall time of all of them. Each engine first serves
the same completions once untimed: an engine's first requests pay its cold start (until 2026-12-07 the float32
engine, measured first, paid it alone: on a host without bfloat16 instructions `ratio` read 2.9 cold and 0.52 warm).

Agreement: every token an engine sampled is scored again by the learner's own forward
(learner/loss.py next_token_logits and token_logprobs, at the same temperature) in float32 and in
bfloat16 autocast. PPO's ratio before any update is exp(learner - engine), 1 where they agree; the
report gives the mean, p99 and largest |difference| and the share of tokens whose ratio already lies
outside the clip range, for each pair (engine dtype, learner dtype).

Learner: learner/step.py train_step on one batch made of the sampled sequences (prompt masked, the
engine's log-probs as the rollout's, advantages +1 and -1 in turn), under `learner.compute_dtype`
float32 and bfloat16 in turn, `--learner-steps` timed steps each after one untimed warm-up step each.

`ratio` = the bfloat16 engine's tokens/s / the float32 engine's; `learner_ratio` the same for the learner's
trained tokens/s. `auto` says what `engines.dtype: auto` and `learner.compute_dtype: auto` choose on this host
(schemas/precision.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, AutoTokenizer

from env_workers.chat_template import ChatEncoder
from env_workers.engine_client import completion_request, parse_completion, served_model
from env_workers.envs import registry
from env_workers.envs.base import EnvSettings
from env_workers.settings import AgentLoopSettings
from learner.loss import next_token_logits, token_logprobs
from learner.microbatch import BatchItem
from learner.settings import LearnerSettings
from learner.step import forward_precision, make_optimizer, train_step
from pipeline.bench.precision_logic import agreement, rate, speedup
from pipeline.bench.rollout import MIX, RANDOM_LARGE, random_large_checkpoint
from pipeline.engine.launch import EngineProcess, launch_engine
from pipeline.policy.model_init import PolicyModelSettings, init_model
from pipeline.run.config import REPO_ROOT, load_config
from schemas.precision import BF16_CPU_FLAGS, cpu_dtype, host_cpu_flags

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Sampled:
    """One completion: its prompt, the tokens the engine sampled and their log-probs."""

    prompt: list[int]
    ids: list[int]
    logprobs: list[float]


def first_prompts(encoder: ChatEncoder, envs: EnvSettings, count: int) -> list[list[int]]:
    """The first-turn prompts of `count` held-out samples, calc and db in turn, as the agent loop encodes them."""

    async def one(i: int) -> list[int]:
        family, split = MIX[i % len(MIX)]
        env = registry.environment(family, envs)
        session = await env.start(registry.sample(family, split, i // len(MIX), envs))
        try:
            return encoder.encode(session.messages, session.tools, add_generation_prompt=True)
        finally:
            await env.end(session)

    async def every() -> list[list[int]]:
        return [await one(i) for i in range(count)]

    return asyncio.run(every())


async def generate(url: str, prompts: Sequence[list[int]], max_new_tokens: int, temperature: float,
                   concurrency: int) -> tuple[list[Sampled], float]:
    """Every prompt's completion from the engine at `url`, `concurrency` at a time, and the wall seconds."""
    gate = asyncio.Semaphore(concurrency)
    model = served_model(url)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=900.0) as http:

        async def one(i: int, prompt: list[int]) -> Sampled:
            body = completion_request(model, prompt, max_new_tokens, temperature, []) | {"ignore_eos": True,
                                                                                          "seed": 1000 + i}
            async with gate:
                response = await http.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            ids, logprobs, _ = parse_completion(response.json(), "bench")
            return Sampled(prompt, ids, logprobs)

        started = time.perf_counter()
        sampled = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return list(sampled), time.perf_counter() - started


def learner_logprobs(model: torch.nn.Module, sampled: Sequence[Sampled], temperature: float,
                     dtype: str) -> list[list[float]]:
    """The learner's log-probs of each completion's sampled tokens (its forward in `dtype`)."""
    out = []
    with torch.no_grad(), forward_precision(LearnerSettings(compute_dtype=dtype), torch.device("cpu")):
        for s in sampled:
            ids = torch.tensor([s.prompt + s.ids])  # (1, T)
            logits = next_token_logits(model, ids, torch.ones_like(ids), temperature)  # (1, T-1, V)
            out.append(token_logprobs(logits, ids)[0, len(s.prompt) - 1:].tolist())  # (len(s.ids),)
    return out


def batch_items(sampled: Sequence[Sampled]) -> list[BatchItem]:
    """One training batch of the completions: prompt masked, the engine's log-probs, advantages +1 and -1."""
    items = []
    for i, s in enumerate(sampled):
        n, m = len(s.prompt), len(s.ids)
        items.append((np.asarray(s.prompt + s.ids, dtype=np.int64),
                      np.concatenate([np.zeros(n, np.float32), np.ones(m, np.float32)]),
                      np.concatenate([np.zeros(n, np.float32), np.asarray(s.logprobs, np.float32)]),
                      1.0 if i % 2 == 0 else -1.0))
    return items


def learner_rates(model_dir: Path, items: Sequence[BatchItem], steps: int, micro_batch_tokens: int,
                  say: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Trained tokens/s of train_step under each compute dtype, steps alternating, after a warm-up step each."""
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = copy.deepcopy(policy).eval()
    settings = {d: LearnerSettings(compute_dtype=d, max_tokens_per_micro_batch=micro_batch_tokens) for d in DTYPES}
    optimizer = make_optimizer(policy, settings["float32"])
    totals = {d: [0, 0.0] for d in DTYPES}
    for step in range(steps + 1):
        for dtype in DTYPES:
            started = time.perf_counter()
            metrics = train_step(policy, reference, optimizer, items, settings[dtype])
            seconds = time.perf_counter() - started
            say(f"learner {dtype}: step {step} {'(warm-up) ' if step == 0 else ''}{seconds:.2f} s, "
                f"{int(metrics['actor/tokens'])} tokens")
            if step:
                totals[dtype][0] += int(metrics["actor/tokens"])
                totals[dtype][1] += seconds
    return {d: rate(tokens, seconds) for d, (tokens, seconds) in totals.items()}


@contextlib.contextmanager
def engines(model_dir: Path, run: str, work_dir: Path, max_model_len: int) -> Iterator[dict[str, EngineProcess]]:
    """One engine per dtype, started together (their start-up overlaps), stopped at the end of the block."""
    started = {d: launch_engine(pool="current", model_dir=model_dir, run=run, work_dir=work_dir / d,
                                engine_id=f"{run}-{d}", cwd=REPO_ROOT,
                                extra_args=("--max-model-len", str(max_model_len), "--dtype", d)) for d in DTYPES}
    try:
        for engine in started.values():
            engine.wait_until_serving(900.0)
        yield started
    finally:
        for engine in started.values():
            engine.stop()


def _fail(message: str) -> None:
    typer.echo(f"rollstream bench precision: {message}", err=True)
    raise typer.Exit(code=2)


def bench_precision(
    model: str | None = typer.Option(None, "--model", help="Checkpoint to measure: a path, or "
                                     f"{RANDOM_LARGE} (Qwen2.5-0.5B's shape, random weights). Default: the "
                                     "configuration's policy.path if it exists, else a fresh `model init`."),
    requests: int = typer.Option(16, "--requests", min=1, help="Completions per engine."),
    concurrency: int = typer.Option(16, "--concurrency", min=1, help="Requests in flight."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", min=1, help="Tokens per completion."),
    learner_steps: int = typer.Option(3, "--learner-steps", min=1, help="Timed learner steps per dtype."),
    micro_batch_tokens: int = typer.Option(LearnerSettings().max_tokens_per_micro_batch, "--micro-batch-tokens",
                                           min=1, help="The learner's micro-batch token budget (lower it for a "
                                                       "large model: its logits are tokens x vocabulary floats)."),
    config: Path | None = typer.Option(None, "--config", help="YAML configuration file (Kafka, MinIO, policy)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """float32 against bfloat16 on this host: engine tokens/s (`ratio` = bfloat16 / float32), the learner's
    trained tokens/s (`learner_ratio`), and how far the learner's log-probs of the engines' tokens are from
    the engines' own in each pairing.

    Example: rollstream bench precision --model random-0.5b --json
    """
    cfg = load_config(config)
    loop = AgentLoopSettings()
    err = Console(stderr=True)
    say = err.print
    run = f"bench-precision-{uuid.uuid4().hex[:10]}"
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-precision-") as work:
        if model == RANDOM_LARGE:
            model_dir = Path(work) / RANDOM_LARGE
            say(f"writing a random {RANDOM_LARGE} checkpoint")
            random_large_checkpoint(model_dir)
        elif model is not None:
            model_dir = Path(model)
            if not (model_dir / "config.json").is_file():
                _fail(f"{model_dir} is not a checkpoint directory (no config.json)")
        elif (cfg.policy_dir() / "config.json").is_file():
            model_dir = cfg.policy_dir()
        else:
            model_dir = Path(work) / "policy"
            init_model(PolicyModelSettings(), model_dir)
            say("measuring a fresh, untrained `model init` policy (pass --model for another)")
        encoder = ChatEncoder(AutoTokenizer.from_pretrained(model_dir))
        prompts = first_prompts(encoder, cfg.envs, requests)
        longest = max(len(p) for p in prompts) + max_new_tokens
        say(f"{requests} prompts of {min(map(len, prompts))}-{max(map(len, prompts)) } tokens; starting an engine "
            f"per dtype on {model_dir}")
        sampled: dict[str, list[Sampled]] = {}
        engine_rates: dict[str, dict[str, Any]] = {}
        with engines(model_dir, run, Path(work) / "engines", longest) as served:
            for dtype, engine in served.items():
                asyncio.run(generate(engine.url, prompts, max_new_tokens, loop.temperature, concurrency))  # warm-up
                sampled[dtype], seconds = asyncio.run(generate(engine.url, prompts, max_new_tokens,
                                                               loop.temperature, concurrency))
                engine_rates[dtype] = rate(sum(len(s.ids) for s in sampled[dtype]), seconds)
                say(f"engine {dtype}: {engine_rates[dtype]['tokens_per_s']:.1f} tokens/s")
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        clip = LearnerSettings()
        agreements = []
        for engine_dtype in DTYPES:
            for learner_dtype in DTYPES:
                scored = learner_logprobs(policy, sampled[engine_dtype], loop.temperature, learner_dtype)
                agreements.append({"engine": engine_dtype, "learner": learner_dtype,
                                   **agreement([s.logprobs for s in sampled[engine_dtype]], scored,
                                               clip.clip_ratio_low, clip.clip_ratio_high)})
        del policy
        learner = learner_rates(model_dir, batch_items(sampled["float32"]), learner_steps, micro_batch_tokens, say)
    flags = host_cpu_flags()
    report = {"run": run, "model": model or str(model_dir), "requests": requests, "concurrency": concurrency,
              "max_new_tokens": max_new_tokens, "temperature": loop.temperature, "micro_batch_tokens": micro_batch_tokens,
              "cpu_bf16_flags": sorted(BF16_CPU_FLAGS & flags),
              "auto": {"engines": cpu_dtype("auto", flags), "learner": cpu_dtype("auto", flags)},
              "engine": engine_rates, "learner": learner, "agreement": agreements,
              "ratio": speedup(engine_rates), "learner_ratio": speedup(learner)}
    if as_json:
        typer.echo(json.dumps(report))
        return
    _print(report)


def _print(report: dict[str, Any]) -> None:
    console = Console()
    rates = Table("stage", "float32 tokens/s", "bfloat16 tokens/s", "bfloat16 / float32",
                  title=f"bench precision: {report['model']} (CPU bf16 flags: "
                        f"{', '.join(report['cpu_bf16_flags']) or 'none'})")
    for name, ratio_key in (("engine", "ratio"), ("learner", "learner_ratio")):
        rows = report[name]
        rates.add_row(name, f"{rows['float32']['tokens_per_s']:.1f}", f"{rows['bfloat16']['tokens_per_s']:.1f}",
                      f"{report[ratio_key]:.2f}")
    console.print(rates)
    agree = Table("engine", "learner", "tokens", "mean |Δ log p|", "p99", "max", "mean Δ", "ratio outside clip",
                  title="learner log-probs of the engine's tokens")
    for a in report["agreement"]:
        agree.add_row(a["engine"], a["learner"], str(a["tokens"]), f"{a['mean_abs']:.2e}", f"{a['p99_abs']:.2e}",
                      f"{a['max_abs']:.2e}", f"{a['mean']:+.2e}", f"{a['outside_clip']:.2%}")
    console.print(agree)
    console.print(f"auto on this host: engines {report['auto']['engines']}, learner {report['auto']['learner']}")
