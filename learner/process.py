"""The learner loop: consume `batches`, train, publish each new version, checkpoint, resume.

Per batch, in this order (ARCHITECTURE.md, "Delivery guarantees"):

    wait     poll `batches`; skip other runs' batches and batches already applied (by id); fetch a
             claim-checked batch whole from MinIO, and the items' token arrays from the
             `trajectories` events they refer to
    train    one optimizer step on the whole batch (learner/step.py, on one rank or several)
    publish  fast path (the pluggable broadcaster, none by default), then stage the version in
             MinIO (shards, then manifest)
    ckpt     every `checkpoint_interval` steps: model, optimizer, RNG, step, version, offsets (and
             SAO's critic, which is never published: it is not part of the policy's weights)
    announce the `weights` event and the step's metrics, flushed: acknowledged by the broker
    commit   the `batches` offsets, only now that the version is durable and announced

Why the checkpoint comes before the announcement: a learner killed between the two resumes from
a checkpoint that already holds the step; it finds the version staged but not announced and
announces it (`plan_resume`). So with checkpoint_interval=1 a SIGKILL at any point loses no step.
With a larger interval, the steps announced after the last checkpoint are lost from the model
state (their batches stay applied: they are not trained twice), and the resume log says so.
"""

from __future__ import annotations

import io
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from confluent_kafka import OFFSET_BEGINNING, OFFSET_STORED, KafkaException
from minio import Minio
from prometheus_client import Gauge

from learner import checkpoint, publish, sao
from learner.microbatch import BatchItem
from learner.settings import LearnerSettings
from schemas import arrays, eventref, objectstore, topics
from schemas.bus import ConsumedEvent, EventConsumer, EventProducer
from schemas.codec import codec
from schemas.settings import KafkaSettings

log = logging.getLogger("rollstream.learner")

# (tensors, version) -> pools that received the version by collective broadcast.
Broadcaster = Callable[[Mapping[str, torch.Tensor], int], Sequence[str]]
# One optimizer step on a whole batch -> metrics (learner/step.py's train_step, bound to its models).
StepFn = Callable[[Sequence[BatchItem]], dict[str, float]]
# The policy's whole state dict / its optimizer's whole state (learner/checkpoint.py, or the ranks' Leader).
WeightsFn = Callable[[], Mapping[str, torch.Tensor]]
OptimizerStateFn = Callable[[], dict[str, Any]]

# What the learner's Prometheus endpoint shows, the newest step's (rank 0 serves it: schemas/prometheus.py).
STEP = Gauge("rollstream_learner_step", "Optimizer steps the run has taken.", registry=None)
WEIGHT_VERSION = Gauge("rollstream_learner_weight_version", "Newest weight version published.", registry=None)
STEP_GAUGES = {
    "actor/loss": Gauge("rollstream_learner_loss", "Loss of the newest step (token mean).", registry=None),
    "actor/kl_loss": Gauge("rollstream_learner_kl", "k3 KL to the reference of the newest step (token mean).",
                           registry=None),
    "actor/pg_clipfrac": Gauge("rollstream_learner_clip_fraction", "Share of action tokens clipped, newest step.",
                               registry=None),
    "perf/tokens_per_s": Gauge("rollstream_learner_tokens_per_second", "Tokens per second of the newest step's "
                               "reference and actor passes.", registry=None),
}
PROMETHEUS = (STEP, WEIGHT_VERSION, *STEP_GAUGES.values())


class ResumeError(RuntimeError):
    """The run's published versions and its checkpoint disagree, or a fresh start would clash."""


class TemplateMismatch(RuntimeError):
    """A batch holds trajectories encoded with another chat template or tokenizer than the policy's."""


def check_template(batch: Mapping[str, Any], expected: str) -> None:
    """Raises TemplateMismatch naming the trajectories whose template fingerprint is not `expected`:
    their token ids would mean something else to the policy being trained."""
    wrong = [item["trajectory"]["trajectory_id"] for item in batch["items"]
             if item["trajectory"]["template_fingerprint"] != expected]
    if wrong:
        raise TemplateMismatch(f"batch {batch['batch_id']}: {len(wrong)} trajectories (e.g. {wrong[0]}) were encoded "
                               f"with a chat template other than the policy's (fingerprint {expected[:12]}…); "
                               f"the env workers and the learner must load the same tokenizer")


@dataclass(frozen=True)
class Published:
    """What a `weights` event of the run says about one version."""

    version: int
    step: int
    batch_id: str | None


@dataclass(frozen=True)
class ResumePlan:
    """How a (re)starting learner continues, decided from plain facts (`plan_resume`)."""

    state: checkpoint.TrainingState
    publish_initial: bool  # version 0 must be staged and announced
    announce_checkpoint_version: bool  # the checkpoint's version is staged but was never announced
    lost_versions: tuple[int, ...]  # announced after the checkpoint: their steps are not in the weights


def plan_resume(
    published: Sequence[Published], ckpt_state: checkpoint.TrainingState | None, *, resume: bool
) -> ResumePlan:
    """Reconciles the checkpoint with the `weights` history of the run (pure)."""
    last = max(published, key=lambda p: p.version) if published else None
    if not resume:
        if last is not None:
            raise ResumeError(f"run already has versions up to {last.version}; pass --resume or use a new run id")
        return ResumePlan(checkpoint.TrainingState(), True, False, ())
    state = ckpt_state if ckpt_state is not None else checkpoint.TrainingState()
    announced_ids = [p.batch_id for p in sorted(published, key=lambda p: p.version) if p.batch_id is not None]
    applied = list(state.applied_batch_ids) + [b for b in announced_ids if b not in set(state.applied_batch_ids)]
    if last is None:
        # Version 0 is announced before the first step, so a checkpoint without it cannot exist.
        if ckpt_state is not None:
            raise ResumeError(f"checkpoint holds version {ckpt_state.version} but the run announced none")
        return ResumePlan(state, True, False, ())
    if ckpt_state is not None and ckpt_state.version > last.version:
        if ckpt_state.version != last.version + 1:
            raise ResumeError(f"checkpoint holds version {ckpt_state.version}, the run announced up to {last.version}")
        return ResumePlan(checkpoint.TrainingState(state.step, state.version, dict(state.offsets), applied),
                          False, True, ())
    lost = tuple(range(state.version + 1, last.version + 1))
    # Version numbers and step numbers keep counting from the last announced one, lost steps included.
    resumed = checkpoint.TrainingState(step=max(state.step, last.step), version=last.version,
                                       offsets=dict(state.offsets), applied_batch_ids=applied)
    return ResumePlan(resumed, False, False, lost)


def _broker_blip(error: Exception, wait_s: float) -> None:
    log.warning("Kafka unavailable (%s): retrying in %.1f s", error, wait_s)


class ReferenceMismatch(ValueError):
    """A batch item's arrays_uri refers to an event of another trajectory."""


def array_refs(batch: Mapping[str, Any]) -> list[str]:
    """The `trajectories` events a batch's trained items keep their token arrays in."""
    return [i["trajectory"]["arrays_uri"] for i in batch["items"]
            if not i["trajectory"]["validation"] and eventref.is_ref(i["trajectory"]["arrays_uri"])]


def batch_items(batch: Mapping[str, Any], fetch: Callable[[str], bytes], *, rewards: bool = False) -> list[BatchItem]:
    """The training content of a `batches` event; validation trajectories are never trained on.

    Each item's scalar is its final advantage, or with `rewards` (SAO, whose batches carry no advantages:
    streams.advantage "none") its trajectory's reward, from which the step computes the advantages.
    Arrays not inline are fetched with `fetch(uri)`: from the `trajectories` event an item refers to
    (kafka://, what the stream processor sends: the event's raw value), or from the object store
    (s3://, an .npz offloaded by the env worker).
    """
    items: list[BatchItem] = []
    for item in batch["items"]:
        t = item["trajectory"]
        if t["validation"]:
            continue
        signal = float(t["reward"]) if rewards else float(item["advantage"])
        uri = t["arrays_uri"]
        if eventref.is_ref(uri):
            source = codec().decode(fetch(uri), "trajectory")
            if source["trajectory_id"] != t["trajectory_id"]:
                raise ReferenceMismatch(f"item {t['trajectory_id']} of batch {batch['batch_id']} refers to {uri}, "
                                        f"an event of trajectory {source['trajectory_id']}")
            t = source
            uri = t["arrays_uri"]
        if uri is not None:
            with np.load(io.BytesIO(fetch(uri))) as npz:
                ids, mask, logprobs = npz["input_ids"], npz["loss_mask"], npz["rollout_logprobs"]
        else:
            ids = arrays.unpack_ids(t["input_ids"])
            mask = arrays.unpack_mask(t["loss_mask"])
            logprobs = arrays.unpack_logprobs(t["rollout_logprobs"])
        items.append((ids, mask, logprobs, signal))
    return items


def behaviour_lag(batch: Mapping[str, Any], version: int) -> int | None:
    """Learner version trained from minus the oldest weight version among the batch's turns."""
    versions = [turn["weight_version"] for item in batch["items"] for turn in item["trajectory"]["turns"]]
    return version - min(versions) if versions else None


def skipped_batch_event(run: str, step: int, batch_id: str, at_ms: int) -> dict[str, Any]:
    """The `metrics` event of a batch the learner consumed without a step (nothing to train on)."""
    return {"run": run, "name": topics.BATCH_SKIPPED_METRIC, "value": 1.0, "step": step, "labels": {"batch_id": batch_id},
            "source": "learner", "at_ms": at_ms}


def metric_events(run: str, step: int, values: Mapping[str, float], at_ms: int) -> list[dict[str, Any]]:
    """One `metrics` event per finite value."""
    return [{"run": run, "name": name, "value": float(v), "step": step, "labels": {}, "source": "learner",
             "at_ms": at_ms} for name, v in values.items() if math.isfinite(v)]


def export_step(step: int, version: int, m: Mapping[str, float]) -> None:
    """Sets the Prometheus gauges to a step's figures (those it has)."""
    STEP.set(step)
    WEIGHT_VERSION.set(version)
    for name, gauge in STEP_GAUGES.items():
        if name in m:
            gauge.set(m[name])


def progress_line(step: int, version: int, m: Mapping[str, float]) -> str:
    """The one-line summary of a step shown on stderr."""
    lag = m.get("rollout/behaviour_lag")
    updates = int(m.get("actor/updates", 1))  # learner.updates_per_batch: the norm is their mean
    return (f"step {step} v{version} pg_loss {m['actor/pg_loss']:+.4f} clipfrac {m['actor/pg_clipfrac']:.3f} "
            f"ppo_kl {m['actor/ppo_kl']:+.2e} kl {m['actor/kl_loss']:.2e} ent {m['actor/entropy']:.3f} "
            f"gnorm {m['actor/grad_norm']:.3f}{f' ({updates} updates)' if updates > 1 else ''} "
            f"{m['perf/tokens_per_s']:.0f} tok/s "
            f"wait {m['timing/wait_s']:.2f}s ref {m['timing/ref_s']:.2f}s actor {m['timing/actor_s']:.2f}s "
            f"publish {m['timing/publish_s']:.2f}s lag {'-' if lag is None else int(lag)}")


def read_published(kafka: KafkaSettings, run: str, producer: EventProducer, idle_s: float = 3.0) -> list[Published]:
    """Every version the run announced on `weights`, read from the start of the topic to its end."""
    consumer = EventConsumer(kafka, group_id=f"learner-history-{run}-{time.time_ns()}", topic_names=[],
                             client_id="learner-history", dlq=producer)
    try:
        ends = consumer.end_offsets(topics.WEIGHTS)
        consumer.assign({topics.WEIGHTS: {p: OFFSET_BEGINNING for p in ends}})
        remaining = {p for p, end in ends.items() if end > 0}
        found: list[Published] = []
        idle_since = time.monotonic()
        while remaining and time.monotonic() - idle_since < idle_s:
            event = consumer.poll(0.5)
            if event is None:
                continue
            idle_since = time.monotonic()
            if event.offset >= ends[event.partition] - 1:
                remaining.discard(event.partition)
            if event.value["run"] == run:
                v = event.value
                found.append(Published(v["version"], v["step"], v["batch_id"]))
        return found
    finally:
        consumer.close()


@dataclass
class LearnerLoop:
    """The learner process around one step function; see the module docstring for the order."""

    run: str
    settings: LearnerSettings
    model: torch.nn.Module  # the policy; a checkpoint is loaded into it (whole, before any sharding)
    optimizer: torch.optim.Optimizer
    step_fn: StepFn
    model_config: dict[str, Any]
    kafka: KafkaSettings
    mc: Minio
    producer: EventProducer
    broadcaster: Broadcaster | None = None
    critic: sao.Critic | None = None
    """SAO's value head (learner/sao.py), which step_fn trains: checkpointed and restored beside the policy,
    never published. None unless settings.advantage_estimator is "sao", which needs it."""
    template_fingerprint: str | None = None
    """The policy tokenizer's (schemas/template.py); batches encoded otherwise are refused. None: unchecked."""
    weights: WeightsFn | None = None
    """What is published and checkpointed; None: the model's own (one process)."""
    optimizer_state: OptimizerStateFn | None = None
    """What is checkpointed of the optimizer; None: the optimizer's own (one process)."""
    max_steps: int | None = None
    """Stop once the run has taken this many steps (None: run until stopped)."""
    idle_exit_s: float | None = None
    """Stop after this long without a batch (None: never; for smoke runs)."""
    should_stop: Callable[[], bool] = lambda: False
    progress: Callable[[str], None] = lambda line: None
    clock: Callable[[], float] = time.perf_counter
    wall_ms: Callable[[], int] = lambda: int(time.time() * 1000)
    aliases: frozenset[str] = field(init=False)
    """Tied tensors' second names (lm_head.weight): never published, the first name carries them."""
    _event_fetcher: eventref.EventFetcher | None = field(init=False, default=None)
    stager: publish.VersionStager = field(init=False)
    """Stages each version full or as a delta on the previous one (learner/publish.py)."""

    def __post_init__(self) -> None:
        if self.settings.sao != (self.critic is not None):
            raise ValueError("a critic is needed with advantage_estimator sao, and only then")
        if self.critic is not None and {id(p) for p in self.critic.head.parameters()} & {
                id(p) for p in self.model.parameters()}:
            # What is published is the policy's state dict: a head inside it would be staged for the engines.
            raise ValueError("SAO's value head must not be a module of the policy: it would be published to engines")
        self.aliases = publish.tied_aliases(self.model)
        self.stager = publish.VersionStager(self.mc, self.run, snapshot_interval=self.settings.snapshot_interval,
                                            max_shard_bytes=self.settings.max_shard_bytes,
                                            zstd_level=self.settings.delta_zstd_level)

    @property
    def _fetcher(self) -> eventref.EventFetcher:
        if self._event_fetcher is None:
            self._event_fetcher = eventref.EventFetcher(self.kafka)
        return self._event_fetcher

    def start(self, *, resume: bool) -> checkpoint.TrainingState:
        """Loads the checkpoint (with --resume), reconciles it with the run's `weights` history,
        and publishes version 0 or re-announces an unannounced checkpoint version."""
        published = read_published(self.kafka, self.run, self.producer)
        ckpt = checkpoint.load_latest(self.mc, self.run) if resume else None
        plan = plan_resume(published, ckpt.state if ckpt else None, resume=resume)
        if ckpt is not None:
            self.model.load_state_dict(ckpt.model)
            checkpoint.load_optimizer_state(self.model, self.optimizer, ckpt.optimizer)
            checkpoint.restore_rng(ckpt.rng)
            if self.critic is not None and ckpt.critic is not None:
                self.critic.load(ckpt.critic)
            elif self.critic is not None:
                log.warning("checkpoint %s holds no critic: SAO's value head starts from zero", ckpt.uri)
            log.info("resumed from checkpoint %s (step %d, version %d)", ckpt.uri, ckpt.state.step, ckpt.state.version)
        elif resume and published:
            log.warning("run %s has no checkpoint: resuming from the initial weights", self.run)
        if plan.lost_versions:
            log.warning("versions %d..%d were announced after the checkpoint: their %d steps are lost from the "
                        "weights and their batches are not trained again", plan.lost_versions[0],
                        plan.lost_versions[-1], len(plan.lost_versions))
        state = plan.state
        if plan.publish_initial:
            self._publish(state, batch_id=None, checkpoint_now=False)
            log.info("published the initial weights as version 0 of run %s", self.run)
        if plan.announce_checkpoint_version:
            staged = publish.load_staged(self.mc, self.run, state.version)
            self._announce(staged, state.applied_batch_ids[-1] if state.applied_batch_ids else None, [], [])
            log.warning("version %d was checkpointed but not announced before the crash: announced it now",
                        state.version)
        export_step(state.step, state.version, {})
        log.info("run %s continues at version %d (step %d); %d batches already applied",
                 self.run, state.version + 1, state.step, len(state.applied_batch_ids))
        return state

    def loop(self, state: checkpoint.TrainingState) -> checkpoint.TrainingState:
        """Consumes `batches` until stopped; returns the final state (checkpointed)."""
        consumer = self._batches_consumer(state)
        applied = set(state.applied_batch_ids)
        uncommitted: list[ConsumedEvent] = []
        checkpointed_step = state.step
        last_batch_at = self.clock()
        try:
            wait_started = self.clock()
            while not self._done(state):
                # A broker restart surfaces here as transient errors: waited out like an idle spell.
                event = eventref.retrying(lambda: consumer.poll(self.settings.poll_timeout_s), "polling batches",
                                          on_retry=_broker_blip)
                if event is None:
                    if self.idle_exit_s is not None and self.clock() - last_batch_at > self.idle_exit_s:
                        log.info("no batch for %.0f s: stopping", self.idle_exit_s)
                        break
                    continue
                last_batch_at = self.clock()
                uncommitted.append(event)
                state.offsets[event.partition] = event.offset + 1
                batch = event.value
                if batch["run"] != self.run:
                    continue
                if batch["batch_id"] in applied:
                    log.info("skipping batch %s (index %d): already applied", batch["batch_id"], batch["index"])
                    continue
                # a batch too large for one message arrives as a claim check: fetched whole and verified
                batch = objectstore.resolve_claim_check(batch, topics.EVENT_OF_TOPIC[topics.BATCHES], self._fetch)
                if self.template_fingerprint is not None:
                    check_template(batch, self.template_fingerprint)
                # the token arrays stay in `trajectories`: read in one pass per partition, not one seek each
                events = self._fetcher.fetch_many(array_refs(batch))
                items = batch_items(batch, lambda uri: events[uri] if uri in events else self._fetch(uri),
                                    rewards=self.settings.sao)
                if not any(int(mask.sum()) for _, mask, _, _ in items):
                    log.warning("skipping batch %s (index %d): no action tokens to train on",
                                batch["batch_id"], batch["index"])
                    # Said out loud: no version answers this batch, and the dispatcher must still
                    # get its groups' credit back or the run stalls.
                    self.producer.send(topics.METRICS, skipped_batch_event(self.run, state.step, batch["batch_id"],
                                                                           self.wall_ms()), key=topics.BATCH_SKIPPED_METRIC)
                    self.producer.flush()
                    continue
                lag = behaviour_lag(batch, state.version)
                metrics = self.step_fn(items)
                state.step += 1
                state.applied_batch_ids.append(batch["batch_id"])
                applied.add(batch["batch_id"])
                metrics["timing/wait_s"] = last_batch_at - wait_started
                if lag is not None:
                    metrics["rollout/behaviour_lag"] = float(lag)
                due = state.step % self.settings.checkpoint_interval == 0
                self._publish(state, batch_id=batch["batch_id"], checkpoint_now=due, metrics=metrics)
                if due:
                    checkpointed_step = state.step
                # only now: the version is durable and announced
                consumer, uncommitted = self._commit(consumer, uncommitted, state)
                export_step(state.step, state.version, metrics)
                self.progress(progress_line(state.step, state.version, metrics))
                wait_started = self.clock()
            if uncommitted:  # skipped batches, or a commit that failed: nothing to make durable first
                consumer, uncommitted = self._commit(consumer, uncommitted, state)
            if checkpointed_step != state.step or self.should_stop():
                self._checkpoint(state)
        finally:
            consumer.close()
            if self._event_fetcher is not None:
                self._event_fetcher.close()
                self._event_fetcher = None
        return state

    def _batches_consumer(self, state: checkpoint.TrainingState) -> EventConsumer:
        """A consumer of `batches` outside group management, placed where the learner stands."""
        consumer = EventConsumer(self.kafka, group_id=f"learner-{self.run}", topic_names=[], client_id="learner",
                                 dlq=self.producer)
        parts = eventref.retrying(lambda: consumer.end_offsets(topics.BATCHES), "reading the batches partitions",
                                  on_retry=_broker_blip)
        # From the checkpoint's (or this process's) offsets where known, else the group's committed
        # offset (or the start).
        consumer.assign({topics.BATCHES: {p: state.offsets.get(p, OFFSET_STORED) for p in parts}})
        return consumer

    def _commit(self, consumer: EventConsumer, uncommitted: list[ConsumedEvent],
                state: checkpoint.TrainingState) -> tuple[EventConsumer, list[ConsumedEvent]]:
        """Commits past `uncommitted`; returns the consumer to go on with and what is still uncommitted.

        A commit that fails is not worth the run: the learner's position is in its checkpoints
        (state.offsets) and a batch applied twice is skipped by id, so the events stay uncommitted
        for the next step. The consumer is replaced, placed at the offsets this process has reached:
        after a broker restart librdkafka's assign()-mode consumer can keep a dead coordinator and
        fail every commit (librdkafka #2791), while a new one finds the live one (a CI run's learner
        exited after 120 s of such failures)."""
        try:
            consumer.commit(uncommitted, timeout_s=self.settings.commit_timeout_s)
            return consumer, []
        except KafkaException as e:
            log.warning("committing %d batch offsets failed (%s): kept for the next step, with a new consumer "
                        "at the offsets reached; the checkpoints hold the position", len(uncommitted), e)
        eventref.close_consumer(consumer, "the old batches consumer")
        return self._batches_consumer(state), uncommitted

    def _done(self, state: checkpoint.TrainingState) -> bool:
        if self.should_stop():
            log.info("stop requested: checkpointing step %d and exiting", state.step)
            return True
        return self.max_steps is not None and state.step >= self.max_steps

    def _fetch(self, uri: str) -> bytes:
        if eventref.is_ref(uri):
            return self._fetcher.fetch(uri)
        return objectstore.get_bytes(self.mc, *objectstore.parse_uri(uri))

    def _publish(self, state: checkpoint.TrainingState, *, batch_id: str | None, checkpoint_now: bool,
                 metrics: dict[str, float] | None = None) -> None:
        """Produces version state.version + 1 (or 0 at the start): broadcast, stage, checkpoint, announce."""
        started = self.clock()
        if batch_id is not None:
            state.version += 1
        whole = self._weights()  # the policy's alone: SAO's critic is a module apart, checkpointed, never served
        tensors = publish.served_tensors(publish.without_aliases(whole, self.aliases), self.settings.publish_dtype)
        pools = list(self.broadcaster(tensors, state.version)) if self.broadcaster is not None else []
        staged = self.stager.stage(tensors, version=state.version, step=state.step, config=self.model_config)
        if checkpoint_now:
            self._checkpoint(state, whole)
        metric_values: dict[str, float] = {}
        if metrics is not None:
            metrics["timing/publish_s"] = self.clock() - started
            busy = metrics["timing/ref_s"] + metrics["timing/actor_s"]
            metrics["perf/tokens_per_s"] = metrics["actor/tokens"] / busy if busy > 0 else 0.0
            metric_values = metrics
        self._announce(staged, batch_id, pools, metric_events(self.run, state.step, metric_values, self.wall_ms()))
        self._prune(state)

    def _announce(self, staged: publish.StagedVersion, batch_id: str | None, pools: Sequence[str],
                  metrics: Sequence[dict[str, Any]]) -> None:
        event = publish.weight_version_event(staged, batch_id=batch_id, broadcast_pools=pools,
                                             published_at_ms=self.wall_ms())
        self.producer.send(topics.WEIGHTS, event, key=self.run)
        for m in metrics:
            self.producer.send(topics.METRICS, m, key=m["name"])
        self.producer.flush()  # acknowledged by the broker before any offset is committed

    def _weights(self) -> Mapping[str, torch.Tensor]:
        return self.weights() if self.weights is not None else checkpoint.full_weights(self.model)

    def _checkpoint(self, state: checkpoint.TrainingState, weights: Mapping[str, torch.Tensor] | None = None) -> None:
        optimizer_state = (self.optimizer_state() if self.optimizer_state is not None
                           else checkpoint.full_optimizer_state(self.model, self.optimizer))
        uri = checkpoint.save_checkpoint(self.mc, self.run, state, dict(weights if weights is not None else self._weights()),
                                         optimizer_state, self.critic.state() if self.critic is not None else None)
        checkpoint.prune_checkpoints(self.mc, self.run, self.settings.keep_checkpoints)
        log.info("checkpoint of step %d (version %d) at %s", state.step, state.version, uri)

    def _prune(self, state: checkpoint.TrainingState) -> None:
        staged = publish.staged_versions(self.mc, self.run)
        keep = publish.retained_versions(
            staged, keep_last=self.settings.keep_versions, stale_step=self.settings.stale_step,
            keep_stale=self.settings.keep_stale_versions,
            checkpoint_versions=[v for _, v in checkpoint.list_checkpoints(self.mc, self.run)],
            chains=self.stager.chains_of(staged),
        )
        deleted = publish.prune_versions(self.mc, self.run, keep)
        if deleted:
            log.debug("pruned versions %s of run %s", deleted, self.run)
