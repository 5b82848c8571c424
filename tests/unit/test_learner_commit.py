"""A `batches` offset commit that fails does not end the learner: the events stay uncommitted for the
next step and a new consumer takes over at the offsets reached (librdkafka #2791: after a broker
restart an assign()-mode consumer can keep a dead coordinator and fail every commit)."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException
from helpers.tiny_learner import tiny_model

from learner.checkpoint import TrainingState
from learner.process import LearnerLoop
from learner.settings import LearnerSettings
from learner.step import make_optimizer
from schemas.bus import ConsumedEvent
from schemas.settings import KafkaSettings


class FakeConsumer:
    def __init__(self, fails: bool) -> None:
        self.fails, self.committed, self.closed = fails, [], False

    def commit(self, events, timeout_s):
        if self.fails:
            raise KafkaException(KafkaError(KafkaError.NOT_COORDINATOR, "Broker: Not coordinator"))
        self.committed.extend(events)

    def close(self):
        self.closed = True


def _loop(replacements: list[FakeConsumer], placed_at: list[dict]) -> LearnerLoop:
    model, settings = tiny_model(), LearnerSettings(commit_timeout_s=0.1)
    loop = LearnerLoop(run="r", settings=settings, model=model, optimizer=make_optimizer(model, settings),
                       step_fn=lambda items: {}, model_config={}, kafka=KafkaSettings(), mc=None, producer=None)

    def new_consumer(state: TrainingState) -> FakeConsumer:
        placed_at.append(dict(state.offsets))
        return replacements.pop(0)

    loop._batches_consumer = new_consumer
    return loop


def _event(offset: int) -> ConsumedEvent:
    return ConsumedEvent("batches", 0, offset, b"r", {}, 0)


def test_a_failed_commit_keeps_the_events_and_replaces_the_consumer_at_the_offsets_reached():
    healthy, placed_at = FakeConsumer(fails=False), []
    loop = _loop([healthy], placed_at)
    broken, events = FakeConsumer(fails=True), [_event(4), _event(5)]
    state = TrainingState(step=3, version=3, offsets={0: 6})
    consumer, left = loop._commit(broken, events, state)
    assert (consumer, left) == (healthy, events)
    assert broken.closed and placed_at == [{0: 6}]
    consumer, left = loop._commit(consumer, left + [_event(6)], state)
    assert consumer is healthy and left == [] and [e.offset for e in healthy.committed] == [4, 5, 6]


def test_a_commit_that_succeeds_keeps_the_consumer():
    placed_at = []
    loop = _loop([], placed_at)
    consumer = FakeConsumer(fails=False)
    assert loop._commit(consumer, [_event(1)], TrainingState(step=1, version=1)) == (consumer, [])
    assert placed_at == [] and not consumer.closed
