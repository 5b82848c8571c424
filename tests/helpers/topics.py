"""Reading what a component publishes: the run's decoded events on some topics from their end on.

The reader is library code (schemas/topic_reader.py), shared with the benchmarks.
"""

from __future__ import annotations

from schemas.topic_reader import TopicReader

__all__ = ["TopicReader"]
