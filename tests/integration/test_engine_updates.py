"""`rollstream engine` against the real vLLM CPU server, Kafka and MinIO: weight updates by the
staged path (a `weights` event, shards from MinIO) and by broadcast (a learner-side process
running learner.broadcast.send_buckets over Gloo), requests in flight during an update, corrupted
shards, and heartbeats.

One engine for the whole module, started through the real entry point (`python -m
pipeline.cli.engine`) as `rollstream up` starts it (tests/helpers/vllm.py), serving a tiny default-architecture policy (head_dim 64). Every update
loads new random weights, and the engine's greedy output (temperature 0) must then equal, token
for token, what a transformers forward pass of the same weights produces greedily.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import safetensors.torch
import torch
from helpers.vllm import serving_engine
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from env_workers.engine_client import WEIGHT_VERSION_HEADER, completion_request
from learner.manifest import ShardIntegrityError, specs_of, write_version
from learner.publish import VersionStager, weight_version_event
from pipeline.cli.engine import app as engine_app
from pipeline.engine.heartbeat import parse_queue_metrics
from pipeline.engine.launch import EngineProcess, free_port
from pipeline.engine.updates import (
    EngineControl,
    UpdateRefused,
    download_version,
    newest_to_load,
    should_load,
)
from pipeline.policy.model_init import PolicyModelSettings, init_model
from schemas import objectstore, topics
from schemas.bus import EventConsumer, EventProducer
from schemas.weight_layout import MANIFEST_FILE, plan_buckets

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = PolicyModelSettings(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=256)
PROMPT = [257, 104, 101, 108, 108, 111]  # <|im_start|> then "hello" as bytes
MAX_SHARD_BYTES = 256 * 1024  # several shards even for the tiny model
BUCKET_BYTES = 128 * 1024  # several broadcast buckets
HEARTBEAT_S = 1.0
STALL_S = 4.0  # the engine's --stall-after-s: busy longer than this with one update or join reads unhealthy


@dataclass
class Engine:
    url: str
    model_dir: Path
    run: str
    engine_id: str
    process: subprocess.Popen
    heartbeats: EventConsumer
    start_s: float
    weights: dict[int, dict[str, torch.Tensor]]
    log_path: Path


@pytest.fixture(scope="module")
def engine(infra, tmp_path_factory) -> Iterator[Engine]:
    model_dir = tmp_path_factory.mktemp("policy")
    init_model(TINY, model_dir)
    run, engine_id = f"engine-test-{uuid.uuid4().hex[:8]}", f"current-{uuid.uuid4().hex[:8]}"
    heartbeats = EventConsumer(infra.kafka, f"test-heartbeats-{engine_id}", [topics.ENGINES], auto_offset_reset="latest")
    heartbeats.poll(2.0)  # join the group before the engine's first heartbeat
    # float32: the engine must serve exactly the learner's weights, compared with a float32 torch forward
    args = ("--max-model-len", "2048", "--heartbeat-s", str(HEARTBEAT_S), "--stall-after-s", str(STALL_S), "--dtype", "float32")
    served: EngineProcess | None = None
    try:
        with serving_engine(model_dir, tmp_path_factory.mktemp("engines"), run=run, engine_id=engine_id,
                            args=args) as (served, start_s):
            initial = _model(model_dir)
            yield Engine(served.url, model_dir, run, engine_id, served.process, heartbeats, start_s,
                         {0: {n: p.detach().clone() for n, p in initial.named_parameters()}}, served.log_path)
    finally:
        heartbeats.close()
        if served is not None:
            print(served.log_tail(1500), file=sys.stderr)


def _model(model_dir: Path, weights: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(weights[name])
    return model


def _random_weights(engine: Engine, seed: int) -> dict[str, torch.Tensor]:
    """New weights for every parameter (embeddings tied to lm_head, as the checkpoint is), scaled
    so that greedy choices are clear-cut rather than near-ties."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in engine.weights[0].items():
        noise = torch.randn(tensor.shape, generator=generator)
        out[name] = 1.0 + 0.1 * noise if "norm" in name else noise * (0.3 if tensor.dim() > 1 else 0.1)
    return out


def _torch_greedy(engine: Engine, weights: dict[str, torch.Tensor], prompt: list[int], count: int) -> list[int]:
    model = _model(engine.model_dir, weights)
    ids, past, out = torch.tensor([prompt]), None, []
    with torch.no_grad():
        for _ in range(count):
            result = model(ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            next_id = int(result.logits[0, -1].argmax())
            out.append(next_id)
            ids = torch.tensor([[next_id]])
    return out


def _engine_greedy(engine: Engine, prompt: list[int], count: int) -> tuple[list[int], int]:
    """(greedy token ids, weight version header) of one completion."""
    body = completion_request(str(engine.model_dir), prompt, count, 0.0, []) | {"ignore_eos": True}
    response = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"], int(response.headers[WEIGHT_VERSION_HEADER])


def _stage(infra, engine: Engine, version: int, weights: dict[str, torch.Tensor], directory: Path,
           corrupt: bool = False) -> dict[str, Any]:
    """Writes the version with learner/manifest.py, uploads it, returns its weight_version event."""
    config = json.loads((engine.model_dir / "config.json").read_text())
    manifest = write_version(directory, weights, version=version, step=version, config=config,
                             max_shard_bytes=MAX_SHARD_BYTES)
    assert len(manifest.shards) >= 2
    if corrupt:  # same size, one byte flipped: only the sha256 can tell
        path = directory / manifest.shards[-1].file
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    mc = objectstore.client(infra.object_store)
    prefix = f"{engine.run}/v{version:06d}/"
    for entry in manifest.shards:
        objectstore.put_file(mc, topics.WEIGHTS_BUCKET, prefix + entry.file, directory / entry.file)
    objectstore.put_file(mc, topics.WEIGHTS_BUCKET, prefix + MANIFEST_FILE, directory / MANIFEST_FILE)
    return {"run": engine.run, "version": version, "step": version, "batch_id": None,
            "manifest_uri": objectstore.uri(topics.WEIGHTS_BUCKET, prefix + MANIFEST_FILE),
            "shards": [{"uri": objectstore.uri(topics.WEIGHTS_BUCKET, prefix + s.file), "sha256": s.sha256,
                        "size_bytes": s.size_bytes} for s in manifest.shards],
            "broadcast_pools": [], "published_at_ms": int(time.time() * 1000)}


def _announce(infra, event: dict[str, Any]) -> None:
    with EventProducer(infra.kafka, client_id="test-learner") as producer:
        producer.send(topics.WEIGHTS, event, key=event["run"])


def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - started


def _heartbeat(engine: Engine, predicate: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        event = engine.heartbeats.poll(0.5)
        if event is not None and event.value["engine_id"] == engine.engine_id and predicate(event.value):
            return event.value
    raise AssertionError(f"no matching heartbeat from {engine.engine_id} within {timeout_s} s")


def _state(engine: Engine) -> dict[str, Any]:
    return EngineControl(engine.url).state()


def test_engine_serves_the_initial_weights_as_version_zero_and_heartbeats(engine):
    assert _engine_greedy(engine, PROMPT, 24) == (_torch_greedy(engine, engine.weights[0], PROMPT, 24), 0)
    beat = _heartbeat(engine, lambda b: b["healthy"], 15)
    assert (beat["pool"], beat["url"], beat["loaded_version"], beat["model"]) == (
        "current", engine.url, 0, str(engine.model_dir))
    assert beat["queue_depth"] >= 0 and beat["running"] >= 0


def test_staged_update_from_a_weights_event_changes_greedy_output_and_version(engine, infra, tmp_path):
    weights = _random_weights(engine, seed=1)
    event = _stage(infra, engine, 1, weights, tmp_path / "v1")
    sent = time.monotonic()
    _announce(infra, event)
    _wait_for(lambda: _state(engine)["version"] == 1, 60, "version 1 to be loaded from MinIO")
    print(f"\nstaged update (event sent -> version served): {time.monotonic() - sent:.2f} s", file=sys.stderr)
    engine.weights[1] = weights
    expected = _torch_greedy(engine, weights, PROMPT, 24)
    assert expected != _torch_greedy(engine, engine.weights[0], PROMPT, 24)
    assert _engine_greedy(engine, PROMPT, 24) == (expected, 1)
    assert _heartbeat(engine, lambda b: b["loaded_version"] == 1, 15)["healthy"]


SENDER = textwrap.dedent("""
    import os, sys, torch, safetensors.torch
    from learner.broadcast import send_buckets
    from learner.manifest import specs_of
    from pipeline.engine.updates import weight_sync_group
    from schemas.weight_layout import plan_buckets
    path, port, bucket_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tensors = safetensors.torch.load_file(path)
    group = weight_sync_group("127.0.0.1", port, rank=0, world_size=2, backend="gloo", timeout_s=120)
    sent = send_buckets(tensors, plan_buckets(specs_of(tensors), bucket_bytes), src=0,
                        device=torch.device("cpu"), group=group)
    print("sent", sent, flush=True)
    # gloo's threads can abort the interpreter's teardown ("terminate called without an active exception",
    # exit -6 after a complete send, seen once in a clean-clone run): the sender's work is done, skip it.
    os._exit(0)
""")


def test_broadcast_update_lets_requests_in_flight_finish_on_the_old_weights(engine, tmp_path):
    old, version = engine.weights[1], 2
    # Sorted by name: the order safetensors.load_file gives the sender, so both sides plan the
    # same bucket layout (a different order would be a collective mismatch).
    weights = dict(sorted(_random_weights(engine, seed=2).items()))
    safetensors.torch.save_file(weights, tmp_path / "v2.safetensors")
    port = free_port()
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(tmp_path / "v2.safetensors"), str(port),
                               str(BUCKET_BYTES)], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    control = EngineControl(engine.url)
    assert control.join("127.0.0.1", port, rank=1, world_size=2)["ok"]

    results: dict[str, Any] = {}

    def run(name: str, fn: Callable[[], Any]) -> threading.Thread:
        def target() -> None:
            try:
                results[name] = fn()
            except Exception as e:  # surfaced by the assertions below, not lost in the thread
                results[name] = e

        thread = threading.Thread(target=target)
        thread.start()
        return thread

    def long_in_flight_or_done() -> bool:
        return "long" in results or _state(engine)["in_flight"] >= 1

    long_tokens = 1900  # max_model_len 2048: long enough to still be decoding when the update starts
    long = run("long", lambda: _engine_greedy(engine, PROMPT, long_tokens))
    _wait_for(long_in_flight_or_done, 120, "the long request to be in flight")
    # On a fast, idle machine the long request can finish before the update starts; the version
    # tag must be exact either way, and the drain is asserted whenever it was seen in flight.
    seen_in_flight = "long" not in results
    receive = run("receive", lambda: control.receive(version, specs_of(weights), BUCKET_BYTES, src=0))
    if seen_in_flight:
        _wait_for(lambda: _state(engine)["updating"] or "receive" in results, 30, "the update to start")
    else:
        receive.join(timeout=300)
    late = run("late", lambda: _engine_greedy(engine, PROMPT, 24))  # during the update, or after it
    for thread in (long, receive, late):
        thread.join(timeout=300)
    assert sender.wait(timeout=60) == 0, sender.stdout.read().decode()[-2000:]
    engine.weights[version] = weights
    assert not any(isinstance(r, Exception) for r in results.values()), results

    print(f"\nbroadcast update: {results['receive']['update_s']:.2f} s in all, of which drain "
          f"{results['receive']['drain_s']:.2f} s, receive {results['receive']['receive_s']:.3f} s, "
          f"load {results['receive']['load_s']:.3f} s ({len(plan_buckets(specs_of(weights), BUCKET_BYTES))} buckets; "
          f"long request {'in flight' if seen_in_flight else 'done before the update'}, "
          f"{results['receive']['drained_requests']} request(s) drained)", file=sys.stderr)
    assert results["receive"]["ok"]
    long_ids, long_version = results["long"]
    if results["receive"]["drained_requests"]:  # it finished on the old weights, and the update waited for it
        assert long_version == 1 and results["receive"]["drain_s"] > 0.0
    else:  # it was seen in flight but finished before the update began: old weights all the same
        assert long_version == 1
    assert long_ids == _torch_greedy(engine, {1: old, version: weights}[long_version], PROMPT, long_tokens)
    assert results["late"] == (_torch_greedy(engine, weights, PROMPT, 24), version)
    assert _engine_greedy(engine, PROMPT, 24) == results["late"]
    assert _heartbeat(engine, lambda b: b["loaded_version"] == version, 15)["healthy"]


def test_corrupted_shard_is_refused_and_the_old_version_stays_loaded(engine, infra, tmp_path):
    event = _stage(infra, engine, 3, _random_weights(engine, seed=3), tmp_path / "v3", corrupt=True)
    mc = objectstore.client(infra.object_store)
    with pytest.raises(ShardIntegrityError, match="sha256"):
        download_version(mc, event, tmp_path / "download")
    # The worker checks a local directory too, before loading anything.
    with pytest.raises(UpdateRefused, match="sha256"):
        EngineControl(engine.url).load(3, tmp_path / "v3")
    _announce(infra, event)
    beat = _heartbeat(engine, lambda b: "version 3 refused" in b["detail"], 30)
    assert "sha256" in beat["detail"] and beat["loaded_version"] == 2 and beat["healthy"]
    assert _state(engine)["version"] == 2
    assert _engine_greedy(engine, PROMPT, 24) == (_torch_greedy(engine, engine.weights[2], PROMPT, 24), 2)


def test_a_delta_chain_is_rebuilt_from_its_snapshot_then_applied_on_the_held_version_and_a_corrupted_delta_refused(
        engine, infra):
    # The learner's stager: version 4 a full snapshot, 5..8 deltas. The engine holds an older
    # version (not in the chain), so version 6 is rebuilt on disk from snapshot 4 then deltas 5 and 6;
    # version 7 is then applied in memory by the worker, on the version 6 it holds.
    mc = objectstore.client(infra.object_store)
    config = json.loads((engine.model_dir / "config.json").read_text())
    stager = VersionStager(mc, engine.run, snapshot_interval=100, max_shard_bytes=MAX_SHARD_BYTES, zstd_level=3)
    generator = torch.Generator().manual_seed(4)
    chain = {4: _random_weights(engine, seed=4)}
    events = {}
    for version in range(4, 9):
        if version > 4:
            chain[version] = {n: t + 0.02 * torch.randn(t.shape, generator=generator) for n, t in chain[version - 1].items()}
        staged = stager.stage(chain[version], version=version, step=version, config=config)
        assert staged.manifest.kind == ("full" if version == 4 else "delta")
        events[version] = weight_version_event(staged, batch_id=None, broadcast_pools=[],
                                               published_at_ms=int(time.time() * 1000))
    assert _state(engine)["version"] < 4

    for version in (6, 7):
        sent = time.monotonic()
        _announce(infra, events[version])
        _wait_for(lambda v=version: _state(engine)["version"] == v, 60, f"version {version} to be loaded")
        print(f"\ndelta update to version {version} (event sent -> version served): "
              f"{time.monotonic() - sent:.2f} s", file=sys.stderr)
        engine.weights[version] = chain[version]
        assert _engine_greedy(engine, PROMPT, 24) == (_torch_greedy(engine, chain[version], PROMPT, 24), version)
    log = engine.log_path.read_text(errors="replace")
    assert "loaded version 6 from MinIO: download" in log
    assert "loaded version 7 from MinIO in memory (1 delta(s) on version 6)" in log

    # A delta whose bytes were damaged in the store: refused in memory, then by the rebuild from the
    # snapshot; version 7 keeps being served.
    bucket, key = objectstore.parse_uri(events[8]["shards"][0]["uri"])
    data = bytearray(objectstore.get_bytes(mc, bucket, key))
    data[len(data) // 2] ^= 0xFF
    objectstore.put_bytes(mc, bucket, key, bytes(data))
    _announce(infra, events[8])
    beat = _heartbeat(engine, lambda b: "version 8 refused" in b["detail"], 30)
    assert "sha256" in beat["detail"] and beat["loaded_version"] == 7 and beat["healthy"]
    assert _engine_greedy(engine, PROMPT, 24) == (_torch_greedy(engine, chain[7], PROMPT, 24), 7)


def test_engine_that_stops_answering_is_marked_unhealthy_within_seconds(engine):
    serving = _state(engine)["version"]
    server = psutil.Process(engine.process.pid).children()[0]  # vLLM's API server
    server.suspend()
    try:
        stopped = time.monotonic()
        beat = _heartbeat(engine, lambda b: not b["healthy"], 20)
        flagged_s = time.monotonic() - stopped
    finally:
        server.resume()
    print(f"\nunanswering engine flagged unhealthy after {flagged_s:.1f} s", file=sys.stderr)
    assert flagged_s < 3 * HEARTBEAT_S + 2 * 2.0 + 2  # heartbeat period + probe timeout, with slack
    assert "probe failed" in beat["detail"] and beat["loaded_version"] == serving
    assert _heartbeat(engine, lambda b: b["healthy"], 20)["loaded_version"] == serving


def test_a_join_whose_rendezvous_never_forms_gives_up_within_its_timeout_and_the_engine_serves_again(engine):
    # make run once stalled here: the learner could not listen on the stale pool's port, and the
    # engine's worker sat in the join for its default 300 s (then retried), generating nothing.
    # While it waits, the engine answers probes but serves nothing: its heartbeat says busy, and past
    # the stall bound unhealthy, so routing stops sending it turns.
    port = free_port()  # nobody listens on it
    started = time.monotonic()
    refused: list[BaseException] = []

    def join() -> None:
        try:
            EngineControl(engine.url).join("127.0.0.1", port, rank=1, world_size=2, timeout_s=3 * STALL_S)
        except UpdateRefused as error:
            refused.append(error)

    joining = threading.Thread(target=join)
    joining.start()
    try:
        stalled = _heartbeat(engine, lambda b: not b["healthy"], 3 * STALL_S)
        stalled_s = time.monotonic() - started
    finally:
        joining.join()
    gave_up_s = time.monotonic() - started
    print(f"\njoin without a rendezvous: heartbeat unhealthy after {stalled_s:.1f} s ({stalled['detail']}), "
          f"gave up after {gave_up_s:.1f} s", file=sys.stderr)
    assert stalled["busy"] == "join" and stalled["busy_for_ms"] > STALL_S * 1000
    assert "stalled: busy (join)" in stalled["detail"]
    assert STALL_S <= stalled_s < gave_up_s
    assert len(refused) == 1 and "joining the weight-sync group failed" in str(refused[0])
    assert gave_up_s < 60
    recovered = _heartbeat(engine, lambda b: b["healthy"], 15)
    assert (recovered["busy"], recovered["busy_for_ms"]) == ("", 0)
    ids, version = _engine_greedy(engine, PROMPT, 8)
    assert len(ids) == 8 and version == _state(engine)["version"]


def test_stale_pool_loads_only_every_stale_step_th_version():
    assert [v for v in range(1, 60) if should_load("stale", v, 0, 25)] == [25, 50]
    assert [v for v in range(1, 5) if should_load("current", v, 2, 25)] == [3, 4]
    assert newest_to_load("current", [3, 5, 4], 2, 25) == 5
    assert newest_to_load("stale", [24, 26], 0, 25) is None
    assert newest_to_load("stale", [25, 49], 0, 25) == 25


def test_queue_metrics_are_read_from_vllm_prometheus_text():
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 7.0\nvllm:num_requests_waiting_by_reason 1\n')
    assert parse_queue_metrics(text) == (7, 3)


def test_engine_command_rejects_a_model_path_without_a_checkpoint(tmp_path):
    result = CliRunner().invoke(engine_app, ["--pool", "current", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not a Hugging Face checkpoint" in result.output


def test_an_engine_whose_broker_is_gone_still_takes_its_vllm_server_down_when_stopped(tmp_path):
    # The supervisor used to flush its last heartbeats before stopping vLLM: with no broker that
    # blocks for minutes, whoever stops it kills it first, and vLLM (in its own session) kept serving.
    model_dir = tmp_path / "policy"
    init_model(TINY, model_dir)
    env = {**os.environ, "ROLLSTREAM_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}"}  # nothing listens
    server_processes: list[psutil.Process] = []
    # Stopped as the launcher stops an engine, with a short patience.
    with serving_engine(model_dir, tmp_path / "engines", args=("--max-model-len", "1024"), env=env,
                        stop_timeout_s=20) as (engine, _):
        time.sleep(3)  # its heartbeats queue up for a broker that never answers
        server_processes = psutil.Process(engine.process.pid).children(recursive=True)
        assert server_processes, "the supervisor runs vLLM as its child"
    _, alive = psutil.wait_procs(server_processes, timeout=30)
    for leftover in alive:
        leftover.kill()
    assert not alive, f"left running after the engine stopped: {[p.pid for p in alive]}"
