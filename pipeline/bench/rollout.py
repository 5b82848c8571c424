"""`rollstream bench rollout`: what the agent loop and its Kafka publishing cost beside the engine
alone, and what a weight update of a running engine costs beside copying and reading the same bytes.

One real engine (`rollstream engine`, following `weights` for the bench's own run id, at the configuration's
`engines.nice` as a run starts it: `--config configs/cpu.yaml` for a CPU machine's 10) serves the policy.

Phase 1 (env worker + engine): `--trajectories` tasks of a fixed mix (calc and db dev samples,
alternating; default four per agent loop, a backlog as a run's dispatcher keeps) go onto `tasks` under the
bench run id, and one real env worker (env_workers/worker.py's
EnvWorker, in this process, with the engine as a static `current` engine and `--concurrency` loops at
once) consumes them, rolls them out and publishes every finished turn to `steps` and every trajectory
to `trajectories` through its own producer, exactly as `rollstream env-worker` does. The tasks are
produced only once the worker's new consumer group has passed over the other runs' tasks on the
shared topic. The timed window runs from the first rollout's start (the worker's own
`started_at_ms`) to the moment the worker's producer has every event acknowledged (a flush after the
last trajectory was sent: the flush time is reported). The events are then read back from the topics
(bench run id) and counted.

Phase 2 (engine alone): the same engine generates the same token counts: one request per turn of
phase 1, with a prompt of that turn's length and max_tokens = the tokens that turn generated
(ignore_eos, no stop tokens, so each request yields exactly that many), at the same temperature,
concurrency and per-turn seed, with no environment and no Kafka in between. The prompts are phase 1's
own with the first token replaced, so the prefix cache phase 1 warmed does not serve them, while they
share prefixes among themselves as the loop's prompts do.

Phase 3 (engine alone, chained): phase 1's trajectories replayed with its dependency: a trajectory's
turn is asked for when its previous turn has returned, `--concurrency` trajectories at a time in phase 1's
order, the next starting as one ends. Each trajectory starts from its first prompt (another first token,
so neither earlier phase's cache serves it); each next prompt is the previous one, the tokens the engine
just generated for it and the environment's tokens phase 1 appended there, so the engine's prefix cache
holds all but those environment tokens, as it did for the loop; lengths and seeds are phase 1's. It is
what the engine gives this workload's shape with no loop, environment or Kafka between the turns.

`ratio` = loop tokens/s / engine-alone tokens/s (1.0: the loop, the environments, Kafka and the
workload's turn-after-turn shape cost nothing); `ratio_chained` = loop / chained tokens/s, the loop's,
environments' and Kafka's cost alone. Each phase also reports where the CPU went (pipeline/bench/cpu.py):
CPU seconds of this process (the env worker, its environments, its Kafka clients), of the engine's
process tree and of a local broker, how long the loop's thread waited for a core, and per generated
token; and from vLLM's own counters its scheduler steps, milliseconds per step and how many requests it
held on average. On cores the engine shares, every CPU second of the loop or the broker is taken from
the engine's steps; `loop_cpu_share` is the loop's CPU per token over the engine's alone.

Weight updates (after the three phases, on the engine that served them): a random new version of the
served model's shape (every tensor, a tied one once, as the learner publishes it) reaches the engine
- by broadcast: the learner's own PoolBroadcaster (join the weight-sync group over Gloo, bucketed
  broadcast, the engine loads the tensors); sent twice, the first forming the group (reported apart),
  the second timed as every later learner step pays it;
- from MinIO: the learner's stage_version (shards, sha256, manifest) and `weights` event, then the
  engine's own follower downloads, verifies and loads it; timed from staging to the engine serving it.
After each, the engine must report the new version (its state and a completion's version header).
Beside them, the machine's memory copy speed for the same number of bytes (one contiguous buffer,
warmed, best of 5: bench weights' copy_baseline) and a read of the same shard files from local disk
(after asking the kernel to drop them from the page cache; posix_fadvise, where the filesystem
honours it). The per-tensor clone of the same tensors (best of 3) is reported apart as
`tensor_clone`: what it adds to the memory copy (an allocation per tensor and the first touch of every
new page) is work any path that builds fresh tensors pays, not the speed of memory; it was reported as
the memory copy until issue 24 (tens of MB/s where memory does GB/s). `--update-model random-0.5b` (or a checkpoint path) repeats the updates on a second
engine serving a ~0.5B-parameter Qwen2 (Qwen2.5-0.5B's shape, random weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import safetensors.torch
import torch
import typer
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, AutoTokenizer, Qwen2Config

from env_workers.chat_template import ChatEncoder
from env_workers.engine_client import WEIGHT_VERSION_HEADER, completion_request, parse_completion, served_model
from env_workers.engines import EnginePool
from env_workers.envs import registry
from env_workers.settings import AgentLoopSettings
from env_workers.worker import EnvWorker, WorkerStats
from env_workers.worker_settings import EnvWorkerSettings
from learner.manifest import write_version
from learner.publish import prune_versions, stage_version, weight_version_event
from learner.settings import LearnerSettings
from pipeline.bench.baselines import copy_baseline
from pipeline.bench.cpu import CpuMeter
from pipeline.bench.learner import LARGE_SHAPE, random_tensors
from pipeline.bench.rollout_logic import (
    Chain,
    TurnRequest,
    caught_up,
    chains,
    cpu_phase,
    engine_phase,
    loop_seconds,
    metric_totals,
    status_counts,
    task_count,
    time_per_turn,
    throughput_row,
    transfer,
    turn_requests,
)
from pipeline.engine.broadcaster import PoolBroadcaster
from pipeline.engine.launch import EngineProcess, free_port, launch_engine
from pipeline.engine.updates import EngineControl
from pipeline.policy.model_init import PolicyModelSettings, build_config, build_tokenizer, init_model
from pipeline.policy.sft import eval_task
from pipeline.run.config import REPO_ROOT, RollstreamConfig, load_config
from schemas import objectstore, topics
from schemas.bus import EventConsumer, EventProducer, now_ms
from schemas.topic_reader import TopicReader
from streams.routing import RoutingPlan, task_event

MIX = (("calc", "dev"), ("db", "dev"))
LEFT_OUT = ("weight updates during the loop (measured apart, below); the env worker's consumer-group join and "
            "its pass over other runs' tasks (timing starts at the first rollout)")
RANDOM_LARGE = "random-0.5b"
# Qwen2.5-0.5B's shape through model_init's builders (head_dim 64, tied embeddings); its padded vocabulary
# (LARGE_SHAPE) is set on the config afterwards, so the byte tokenizer still fits.
LARGE_POLICY = PolicyModelSettings(hidden_size=LARGE_SHAPE["hidden_size"], num_layers=LARGE_SHAPE["num_hidden_layers"],
                                   num_heads=LARGE_SHAPE["num_attention_heads"],
                                   num_kv_heads=LARGE_SHAPE["num_key_value_heads"],
                                   intermediate_size=LARGE_SHAPE["intermediate_size"], vocab_size=256)
CATCH_UP_TIMEOUT_S = 120.0

app = typer.Typer(help="Agent-loop throughput beside the engine alone; weight-update times.")


@dataclass
class LoopPhase:
    """What phase 1 measured: the trajectories and steps read back from Kafka, and its timings."""

    trajectories: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    stats: WorkerStats
    seconds: float
    flush_s: float
    usage: PhaseUsage


@dataclass
class PhaseUsage:
    """CPU and engine counters sampled at a phase's start and end (CpuMeter.sample, vLLM's /metrics)."""

    cpu_before: dict[str, float | None]
    cpu_after: dict[str, float | None]
    engine_before: dict[str, float]
    engine_after: dict[str, float]
    seconds: float


@contextlib.contextmanager
def usage_of(meter: CpuMeter, url: str) -> Iterator[list[PhaseUsage]]:
    """Samples CPU and the engine's counters around the block; the list holds the PhaseUsage after it."""
    out: list[PhaseUsage] = []
    engine_before, cpu_before, started = engine_counters(url), meter.sample(), time.perf_counter()
    yield out
    seconds, cpu_after = time.perf_counter() - started, meter.sample()
    out.append(PhaseUsage(cpu_before, cpu_after, engine_before, engine_counters(url), seconds))


def engine_counters(url: str) -> dict[str, float]:
    """The engine's Prometheus counters summed over labels ({} when it exports none)."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    return metric_totals(response.text) if response.status_code == 200 else {}


@contextlib.contextmanager
def engine_for(model_dir: Path, run: str, work_dir: Path, max_model_len: int, nice: int = 0) -> Iterator[EngineProcess]:
    """One real `rollstream engine` following `weights` of `run`, for the duration of the block, at
    niceness `nice` (the configuration's `engines.nice`, as a run starts its engines)."""
    engine = launch_engine(pool="current", model_dir=model_dir, run=run, work_dir=work_dir,
                           extra_args=("--max-model-len", str(max_model_len)), cwd=REPO_ROOT, nice=nice)
    try:
        engine.wait_until_serving(600.0)
        yield engine
    finally:
        engine.stop()


def bench_tasks(run: str, count: int, max_turns: int) -> list[dict[str, Any]]:
    """`tasks` events of the mix under `run`, every turn planned on the current pool."""
    now = now_ms()
    plan = RoutingPlan(["current"] * max_turns, seed=0, stale_ratio=0.0, reason="bench rollout", stale_version=None)
    return [task_event(eval_task(run, *MIX[i % len(MIX)], i // len(MIX))["request"], plan, now) for i in range(count)]


async def _until_caught_up(worker: EnvWorker, kafka: Any, say: Callable[[str], None]) -> None:
    """Waits until the worker's new group has passed over every task already on the topic."""
    probe = EventConsumer(kafka, worker.consumer.group_id, [])  # not subscribed: it never joins the group
    try:
        deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
        while not caught_up(probe.end_offsets(topics.TASKS), probe.committed(topics.TASKS)):
            if worker.failure is not None:
                return  # the worker's run() raises it
            if time.monotonic() > deadline:
                say(f"the env worker had not passed over the older tasks after {CATCH_UP_TIMEOUT_S:.0f} s; going on")
                return
            await asyncio.sleep(0.25)
    finally:
        probe.close()


async def loop_phase(cfg: RollstreamConfig, settings: EnvWorkerSettings, model_name: str, encoder: ChatEncoder,
                     tasks: Sequence[dict[str, Any]], run: str, meter: CpuMeter, say: Callable[[str], None]
                     ) -> LoopPhase:
    """Phase 1: one real env worker rolls `tasks` out from `tasks` and publishes steps and trajectories;
    `meter` samples CPU from the tasks' production until every event is acknowledged."""
    engines = EnginePool(run=run, stop_token_ids=[encoder.eos_token_id], clock_ms=now_ms,
                         heartbeat_timeout_s=settings.heartbeat_timeout_s,
                         failure_backoff_s=settings.engine_failure_backoff_s,
                         timeout_s=settings.agent_loop.engine_timeout_s)
    engines.add_static(settings.engine_urls, model_name)
    worker = EnvWorker(settings, cfg.kafka, encoder, engines, run=run, worker_id=f"bench-rollout-{run}",
                       clock=time.time)
    reader = TopicReader(cfg.kafka, [topics.STEPS, topics.TRAJECTORIES], run=run)
    reader.pause()  # read back after the timed window, so that its fetches are not counted in it
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        await _until_caught_up(worker, cfg.kafka, say)
        with usage_of(meter, settings.engine_urls["current"][0]) as usage:
            with EventProducer(cfg.kafka, client_id=f"bench-rollout-feed-{run}") as feed:
                for task in tasks:
                    feed.send(topics.TASKS, task, key=task["request"]["group_id"])
            say(f"phase 1: {len(tasks)} tasks on `tasks`, rolled out by the env worker, "
                f"{settings.max_concurrency} at a time")
            while worker.stats.trajectories < len(tasks):
                if running.done():
                    break  # it failed: awaited below, which raises
                await asyncio.sleep(0.01)
            sent = time.time()
            # The worker's own producer, from this event-loop thread as the worker calls it: every step and
            # trajectory acknowledged by the broker closes the timed window.
            worker.producer.flush()
            acknowledged = time.time()
    finally:
        stop.set()
        stats = await running
        await engines.aclose()
    try:
        reader.resume()
        reader.wait_for(lambda: len(reader.events[topics.TRAJECTORIES]) >= stats.trajectories
                        and len(reader.events[topics.STEPS]) >= stats.steps, 60.0,
                        "the bench run's steps and trajectories to be read back")
    finally:
        reader.close()
    trajectories = reader.events[topics.TRAJECTORIES]
    return LoopPhase(trajectories, reader.events[topics.STEPS], stats, loop_seconds(trajectories, acknowledged),
                     acknowledged - sent, usage[0])


async def _complete(http: httpx.AsyncClient, url: str, model: str, request: TurnRequest, temperature: float
                    ) -> list[int]:
    """The ids the engine generated for one engine-alone request (exactly `request.count`: ignore_eos)."""
    body = completion_request(model, request.prompt, request.count, temperature, []) | {"ignore_eos": True}
    if request.seed is not None:
        body["seed"] = request.seed
    response = await http.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    return parse_completion(response.json(), "bench")[0]


async def engine_alone(url: str, model: str, requests: Sequence[TurnRequest], temperature: float,
                       concurrency: int) -> tuple[int, float]:
    """Phase 2: (tokens generated, wall seconds) for `requests`, `concurrency` at a time, independent of
    each other (the engine's own rate on these requests)."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=600.0) as http:

        async def one(request: TurnRequest) -> int:
            async with gate:
                return len(await _complete(http, url, model, request, temperature))

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(request) for request in requests))
        return sum(counts), time.perf_counter() - started


async def engine_chained(url: str, model: str, trajectories: Sequence[Chain], temperature: float,
                         concurrency: int) -> tuple[int, float]:
    """Phase 3: (tokens generated, wall seconds) for `trajectories`, each one's turns in order, `concurrency`
    trajectories at a time: the loop's dependency and admission without the loop."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=None), timeout=600.0) as http:

        async def one(chain: Chain) -> int:
            prompt, tokens = list(chain.prompt), 0
            async with gate:
                for count, seed, following in zip(chain.counts, chain.seeds, chain.following, strict=True):
                    generated = await _complete(http, url, model, TurnRequest(prompt, count, seed), temperature)
                    tokens += len(generated)
                    prompt = prompt + generated + following
            return tokens

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(chain) for chain in trajectories))
        return sum(counts), time.perf_counter() - started


# --- weight updates ---------------------------------------------------------------------------------


def served_version(url: str) -> tuple[int, int]:
    """(version in the engine's state, version header of a one-token completion)."""
    state = EngineControl(url).state()["version"]
    body = completion_request(served_model(url), [0], 1, 0.0, [], allowed_token_ids=[0])
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return int(state), int(response.headers[WEIGHT_VERSION_HEADER])


def _require_version(url: str, version: int, path: str) -> int:
    reported = served_version(url)
    if reported != (version, version):
        raise RuntimeError(f"after the {path} update to version {version} the engine reports {reported} "
                           "(state, completion header)")
    return version


def copy_seconds(tensors: dict[str, torch.Tensor]) -> float:
    """Seconds to copy every tensor into new memory (the copy is dropped at once)."""
    started = time.perf_counter()
    copies = {name: tensor.clone() for name, tensor in tensors.items()}
    seconds = time.perf_counter() - started
    del copies
    return seconds


def read_seconds(paths: Sequence[Path]) -> tuple[int, float]:
    """(bytes, seconds) to read `paths` whole, after asking the kernel to drop them from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    nbytes, started = 0, time.perf_counter()
    for path in paths:
        with open(path, "rb") as f:
            nbytes += len(f.read())
    return nbytes, time.perf_counter() - started


def update_times(cfg: RollstreamConfig, engine: EngineProcess, run: str, label: str, model_dir: Path,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """Loads a random new version of `model_dir`'s shape into the running `engine` by broadcast and from
    MinIO, beside a memory copy and a file read of the same bytes (see the module docstring)."""
    config = AutoConfig.from_pretrained(model_dir)
    settings = LearnerSettings()
    tensors = random_tensors(config)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    say(f"{label}: weight updates of {nbytes / 2**20:.0f} MB")
    memory = transfer(nbytes, copy_baseline(nbytes)["memory_copy_s"])
    clone = transfer(nbytes, min(copy_seconds(tensors) for _ in range(3)))  # best of 3: the machine is shared
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-shards-") as tmp:
        manifest = write_version(Path(tmp), tensors, version=0, step=0, config=config.to_dict(),
                                 max_shard_bytes=settings.max_shard_bytes)
        file_read = transfer(*read_seconds([Path(tmp) / shard.file for shard in manifest.shards]))

    broadcaster = PoolBroadcaster(pool="current", urls=[engine.url], host="127.0.0.1", port=free_port(),
                                  bucket_size_bytes=settings.bucket_size_bytes)
    started = time.perf_counter()
    broadcaster.send(tensors, 1)  # forms the weight-sync group, once per learner
    first_s = time.perf_counter() - started
    _require_version(engine.url, 1, "broadcast")
    started = time.perf_counter()
    broadcaster.send(tensors, 2)
    broadcast = transfer(nbytes, time.perf_counter() - started, first_seconds=first_s,
                         version=_require_version(engine.url, 2, "broadcast"))

    mc = objectstore.client(cfg.object_store)
    objectstore.ensure_buckets(mc, [topics.WEIGHTS_BUCKET])
    started = time.perf_counter()
    staged = stage_version(mc, run, tensors, version=3, step=3, config=config.to_dict(),
                           max_shard_bytes=settings.max_shard_bytes)
    stage_s = time.perf_counter() - started
    try:
        with EventProducer(cfg.kafka, client_id=f"bench-rollout-learner-{run}") as producer:
            producer.send(topics.WEIGHTS, weight_version_event(staged, batch_id=None, broadcast_pools=[],
                                                               published_at_ms=now_ms()), key=run)
        control, deadline = EngineControl(engine.url), time.monotonic() + 600
        while control.state()["version"] != 3:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not load version 3 from MinIO:\n{engine.log_tail()}")
            time.sleep(0.02)
        total_s = time.perf_counter() - started
    finally:
        prune_versions(mc, run, keep=set())
    staged_row = transfer(sum(s.size_bytes for s in staged.manifest.shards), total_s, stage_seconds=stage_s,
                          load_seconds=total_s - stage_s, version=_require_version(engine.url, 3, "MinIO"))
    return {"model": label, "checkpoint": str(model_dir), "parameters": sum(t.numel() for t in tensors.values()),
            "bytes": nbytes, "memory_copy": memory, "tensor_clone": clone, "file_read": file_read, "broadcast": broadcast,
            "staged": staged_row}


def random_large_checkpoint(out: Path) -> None:
    """A random ~0.5B Qwen2 checkpoint (Qwen2.5-0.5B's shape) with the byte tokenizer, written without
    Hugging Face's slow initialization. Its weights are the negation of `random_tensors`, so the versions
    the bench then loads differ from what it serves."""
    tokenizer = build_tokenizer()
    config = build_config(LARGE_POLICY, tokenizer)
    config.vocab_size = LARGE_SHAPE["vocab_size"]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)
    tensors = random_tensors(config)
    safetensors.torch.save_file({n: t.neg_() for n, t in tensors.items()}, out / "model.safetensors",
                                metadata={"format": "pt"})


# --- the command ------------------------------------------------------------------------------------


def _fail(message: str) -> None:
    typer.echo(f"rollstream bench rollout: {message}", err=True)
    raise typer.Exit(code=2)


def _is_qwen2(model_dir: Path) -> bool:
    return isinstance(AutoConfig.from_pretrained(model_dir), Qwen2Config)


def bench_rollout(
    model: Path | None = typer.Option(None, "--model", help="Checkpoint to serve (default: a fresh `model init`)."),
    trajectories: int | None = typer.Option(None, "--trajectories", help="Tasks in phase 1 (calc and db "
                                            "alternating; default: 4 x --concurrency, a backlog as a run keeps, "
                                            "at most the mix's distinct tasks)."),
    concurrency: int = typer.Option(16, "--concurrency", help="Agent loops (and requests) in flight."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Tokens per turn."),
    update_model: str | None = typer.Option(None, "--update-model", help="Also time weight updates of this "
                                            f"checkpoint (a path, or {RANDOM_LARGE}: Qwen2.5-0.5B's shape, random "
                                            "weights) on a second engine; several minutes and GBs on CPU."),
    config: Path | None = typer.Option(None, "--config", help="YAML configuration file (Kafka and MinIO)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Tokens/s and trajectories/s of a real env worker (agent loops, environments, Kafka publishing)
    against one engine, beside the engine alone generating the same token counts (`ratio` = loop
    tokens/s / engine-alone tokens/s); then weight-update time by broadcast and from MinIO beside a
    memory copy and a file read of the same bytes.

    Example: rollstream bench rollout --model .run/policy-sft --update-model random-0.5b --json
    """
    if (trajectories is not None and trajectories < 1) or concurrency < 1 or max_new_tokens < 1:
        _fail("--trajectories, --concurrency and --max-new-tokens must be positive")
    for given in (model, None if update_model in (None, RANDOM_LARGE) else Path(update_model)):
        if given is not None and not (given / "config.json").is_file():
            _fail(f"{given} is not a checkpoint directory (no config.json)")
        if given is not None and not _is_qwen2(given):
            _fail(f"{given} is not a Qwen2-architecture checkpoint (weight updates are timed on Qwen2 shapes)")
    cfg = load_config(config)
    envs = load_config().envs
    try:
        trajectories = task_count(trajectories, concurrency, [len(registry.samples(f, s, envs)) for f, s in MIX])
    except ValueError as error:
        _fail(str(error))
    loop = AgentLoopSettings(max_new_tokens=max_new_tokens)
    run = f"bench-rollout-{uuid.uuid4().hex[:10]}"
    err = Console(stderr=True)
    say = err.print
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-rollout-") as work:
        if model is None:
            model = Path(work) / "policy"
            init_model(PolicyModelSettings(), model)
            say("serving a fresh, untrained `model init` policy (pass --model for a fine-tuned one)")
        encoder = ChatEncoder(AutoTokenizer.from_pretrained(model))
        tasks = bench_tasks(run, trajectories, loop.max_turns)
        for task in tasks:  # resolve every sample before timing (loading a split is not the loop's cost)
            registry.sample(task["request"]["task"], task["request"]["split"], task["request"]["sample_index"], envs)
        with engine_for(model, run, Path(work) / "engines", loop.max_total_len, cfg.engines.nice) as engine:
            name = served_model(engine.url)
            settings = EnvWorkerSettings(max_concurrency=concurrency, engine_urls={"current": [engine.url]}, model=name,
                                         env=envs, agent_loop=loop)
            say(f"engine serving {model} (run {run}, niceness {cfg.engines.nice})")
            meter = CpuMeter(engine.process.pid)
            phase = asyncio.run(loop_phase(cfg, settings, name, encoder, tasks, run, meter, say))
            requests = turn_requests(phase.trajectories, encoder.eos_token_id, settings.seeded_sampling)
            say(f"phase 2: the engine alone, {len(requests)} requests of the same lengths")
            with usage_of(meter, engine.url) as alone_usage:
                alone_tokens, alone_s = asyncio.run(engine_alone(engine.url, name, requests, loop.temperature,
                                                                 concurrency))
            # Another first token than phase 2's, so neither phase's prefix cache serves the other.
            replay = chains(phase.trajectories, 0 if encoder.eos_token_id > 1 else 2, settings.seeded_sampling)
            say(f"phase 3: the engine alone, the same requests chained per trajectory, {concurrency} at a time")
            with usage_of(meter, engine.url) as chained_usage:
                chained_tokens, chained_s = asyncio.run(engine_chained(engine.url, name, replay, loop.temperature,
                                                                       concurrency))
            updates = [update_times(cfg, engine, run, "default", model, say)]
        if update_model is not None:
            large = Path(update_model) if update_model != RANDOM_LARGE else Path(work) / RANDOM_LARGE
            if update_model == RANDOM_LARGE:
                say(f"writing a random {RANDOM_LARGE} checkpoint")
                random_large_checkpoint(large)
            with engine_for(large, run, Path(work) / "engines-update", 1024) as engine:
                updates.append(update_times(cfg, engine, run, update_model, large, say))
    loop_tokens = sum(turn["length"] for t in phase.trajectories for turn in t["turns"])
    loop_row = throughput_row("env worker + engine", len(phase.trajectories), len(requests), loop_tokens, phase.seconds)
    alone_row = throughput_row("engine alone", len(phase.trajectories), len(requests), alone_tokens, alone_s)
    chained_row = throughput_row("engine alone, chained", len(replay), sum(len(c.counts) for c in replay),
                                 chained_tokens, chained_s)
    usages = {"loop": (phase.usage, loop_tokens), "engine_alone": (alone_usage[0], alone_tokens),
              "engine_chained": (chained_usage[0], chained_tokens)}
    cpu = {name: cpu_phase(u.cpu_before, u.cpu_after, u.seconds, tokens, meter.cores)
           for name, (u, tokens) in usages.items()}
    engine_use = {name: engine_phase(u.engine_before, u.engine_after, u.seconds) for name, (u, _) in usages.items()}
    loop_ms, engine_ms = cpu["loop"]["loop_ms_per_token"], cpu["engine_alone"]["engine_ms_per_token"]
    report = {"run": run, "model": str(model), "mix": [f"{f}/{s}" for f, s in MIX], "concurrency": concurrency,
              "engine_niceness": cfg.engines.nice,
              "max_new_tokens": max_new_tokens, "temperature": loop.temperature,
              "seeded_sampling": settings.seeded_sampling, "loop": loop_row, "engine_alone": alone_row,
              "engine_chained": chained_row, "ratio": loop_row["tokens_per_s"] / alone_row["tokens_per_s"],
              "ratio_chained": loop_row["tokens_per_s"] / chained_row["tokens_per_s"],
              "events": {"steps": len(phase.steps), "trajectories": len(phase.trajectories),
                         "flush_s": phase.flush_s},
              "statuses": status_counts(phase.trajectories), "time_per_turn": time_per_turn(phase.trajectories),
              "cpu": cpu, "engine": engine_use,
              "loop_cpu_share": loop_ms / engine_ms if loop_ms is not None and engine_ms else None,
              "weight_updates": updates, "left_out": LEFT_OUT}
    if as_json:
        typer.echo(json.dumps(report))
        return
    _print(report)


def _print(report: dict[str, Any]) -> None:
    console = Console()
    table = Table(title=f"rollout throughput (calc + db, concurrency {report['concurrency']}, "
                        f"temperature {report['temperature']})")
    for column in ("phase", "trajectories", "turns", "tokens", "seconds", "tokens/s", "trajectories/s"):
        table.add_column(column)
    for row in (report["loop"], report["engine_alone"], report["engine_chained"]):
        table.add_row(row["name"], str(row["trajectories"]), str(row["turns"]), str(row["tokens"]),
                      f"{row['seconds']:.2f}", f"{row['tokens_per_s']:.0f}", f"{row['trajectories_per_s']:.2f}")
    console.print(table)
    events = report["events"]
    console.print(f"ratio (loop tokens/s / engine-alone tokens/s): {report['ratio']:.3f}; against the engine alone "
                  f"with each trajectory's turns chained: {report['ratio_chained']:.3f}; statuses {report['statuses']}")
    usage = Table(title=f"where the CPU went (engine niceness {report['engine_niceness']})")
    usage.add_column("figure")
    phases = ("loop", "engine_alone", "engine_chained")
    for name in phases:
        usage.add_column(report[name]["name"])

    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = (("loop process CPU s (env worker, environments, Kafka clients)", "cpu", "loop_cpu_s", ".1f"),
            ("loop thread runnable, waiting for a core, s", "cpu", "loop_thread_wait_s", ".1f"),
            ("engine CPU s (its process tree)", "cpu", "engine_cpu_s", ".1f"),
            ("broker CPU s", "cpu", "broker_cpu_s", ".1f"),
            ("loop CPU ms per generated token", "cpu", "loop_ms_per_token", ".3f"),
            ("engine CPU ms per generated token", "cpu", "engine_ms_per_token", ".3f"),
            ("machine busy", "cpu", "machine_busy_share", ".0%"),
            ("engine scheduler steps", "engine", "steps", ".0f"),
            ("engine ms per step", "engine", "ms_per_step", ".1f"),
            ("requests inside the engine, mean", "engine", "mean_requests_inside", ".1f"))
    for label, section, key, spec in rows:
        usage.add_row(label, *(num(report[section][name][key], spec) for name in phases))
    console.print(usage)
    turn = report["time_per_turn"]
    console.print(f"per turn of the loop: {turn['generate_ms']:.0f} ms in the engine call, "
                  f"{turn['environment_ms']:.1f} ms in the environment, {turn['loop_ms']:.1f} ms in the rest of the "
                  f"loop; the loop's CPU per token is {num(report['loop_cpu_share'], '.1%')} of the engine's alone")
    console.print(f"published (read back from Kafka, run {report['run']}): {events['steps']} steps, "
                  f"{events['trajectories']} trajectories; producer flush after the last trajectory "
                  f"{events['flush_s'] * 1000:.1f} ms")
    updates = Table(title="weight update of the running engine, beside the same bytes copied and read")
    for column in ("model", "path", "MB", "seconds", "MB/s", "engine reports"):
        updates.add_column(column)
    for u in report["weight_updates"]:
        label = f"{u['model']} ({u['parameters'] / 1e6:.1f}M params)"
        rows = [("broadcast (Gloo)", u["broadcast"], f"v{u['broadcast']['version']}; first send, forming the "
                 f"group: {u['broadcast']['first_seconds']:.2f} s"),
                ("MinIO staged", u["staged"], f"v{u['staged']['version']}; stage {u['staged']['stage_seconds']:.2f} s "
                 f"+ engine download/verify/load {u['staged']['load_seconds']:.2f} s"),
                ("memory copy", u["memory_copy"], "one warmed contiguous buffer"),
                ("tensor clones", u["tensor_clone"], "per tensor: allocation and first touch included"),
                ("file read", u["file_read"], "")]
        for path, figures, note in rows:
            updates.add_row(label, path, f"{figures['bytes'] / 2**20:.1f}", f"{figures['seconds']:.3f}",
                            f"{figures['mb_per_s']:.0f}", note)
    console.print(updates)
    console.print(f"left out: {report['left_out']}")


app.command("rollout")(bench_rollout)
