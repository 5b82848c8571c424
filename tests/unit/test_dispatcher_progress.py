"""The dispatcher's view of training progress: which groups no longer hold in-flight credit."""

from pipeline.dispatch.dispatcher import Progress


def test_groups_count_as_trained_once_a_newer_version_answers_their_batch():
    progress = Progress(learner_version=3, batches={"b1": (2, ["g1", "g2"]), "b2": (3, ["g3"])})
    assert progress.trained() == {"g1", "g2"}


def test_a_batch_the_learner_skipped_gives_its_groups_credit_back():
    progress = Progress(learner_version=1, batches={"b1": (1, ["g1"])}, skipped_batches={"b1"})
    assert progress.trained() == {"g1"}
