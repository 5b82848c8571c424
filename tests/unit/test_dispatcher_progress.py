"""The dispatcher's view of training progress: which groups no longer hold in-flight credit, and whether an
alert holds it (paused until a resume, stopped for good). The reader's Kafka consumer is a stub here."""

from pipeline.dispatch.dispatcher import Progress, ProgressReader
from schemas import samples, topics
from schemas.codec import codec
from streams.alerts import RunHold, resume_event


def test_groups_count_as_trained_once_a_newer_version_answers_their_batch():
    progress = Progress(learner_version=3, batches={"b1": (2, ["g1", "g2"]), "b2": (3, ["g3"])})
    assert progress.trained() == {"g1", "g2"}


def test_a_batch_the_learner_skipped_gives_its_groups_credit_back():
    progress = Progress(learner_version=1, batches={"b1": (1, ["g1"])}, skipped_batches={"b1"})
    assert progress.trained() == {"g1"}


class _Message:
    def __init__(self, topic: str, value: dict) -> None:
        self._topic, self._value = topic, codec().encode(topics.EVENT_OF_TOPIC[topic], value)

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self._topic

    def value(self) -> bytes:
        return self._value

    def _decoded(self) -> dict:
        return codec().decode(self._value, topics.EVENT_OF_TOPIC[self._topic])


class _StubConsumer:
    """Hands out the prepared messages, one batch per consume."""

    def __init__(self, batches: list[list[_Message]]) -> None:
        self.batches = batches

    def consume(self, num_messages: int, timeout: float) -> list[_Message]:
        return self.batches.pop(0) if self.batches else []


def _reader(batches: list[list[_Message]], hold: RunHold | None = None) -> ProgressReader:
    reader = ProgressReader.__new__(ProgressReader)  # no Kafka client: the stub stands in for its reader
    reader.run, reader.progress, reader._reader = "r", Progress(hold=hold or RunHold()), _StubConsumer(batches)
    return reader


def _alert(action: str, run: str = "r", n: int = 1) -> _Message:
    return _Message(topics.ALERTS, {**samples.alert(), "run": run, "alert_id": f"{run}/truncating/os/{n}",
                                    "rule": "truncating", "action": action})


def test_a_pause_alert_of_its_run_holds_the_dispatcher_until_a_resume_is_read():
    reader = _reader([[_alert("pause", run="other")], [_alert("alert")], [_alert("pause", n=3)],
                      [_Message(topics.ALERTS, resume_event("r", "cli", 1))]])
    assert reader.poll(0).hold.held_by is None  # another run's pause
    assert reader.poll(0).hold.held_by is None  # a rule that only records
    assert reader.poll(0).hold.held_by == "truncating"
    assert reader.poll(0).hold.held_by is None


def test_a_dispatcher_started_after_a_pause_is_held_from_the_start_and_reading_it_again_changes_nothing():
    hold = RunHold()
    hold.apply(_alert("pause")._decoded())
    reader = _reader([[_alert("pause")]], hold)  # the reader starts from the topic's beginning: the same alert
    assert reader.progress.hold.held_by == "truncating"
    assert reader.poll(0).hold.held_by == "truncating"


def test_a_stop_alert_holds_the_dispatcher_for_good():
    reader = _reader([[_alert("stop")], [_Message(topics.ALERTS, resume_event("r", "cli", 1))]])
    reader.poll(0)
    assert reader.poll(0).hold.held_by == "truncating"
