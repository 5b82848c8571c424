"""A minimal Faust app with a changelog-backed table, run as its own process by
test_faust_changelog.py: counts events per key and reports each new count to an output topic.

Usage: python faust_counter_app.py BROKER APP_ID IN_TOPIC OUT_TOPIC DATADIR
"""

import sys

import faust
from faust.worker import Worker

broker, app_id, in_topic, out_topic, datadir = sys.argv[1:6]

app = faust.App(app_id, broker=broker, datadir=datadir, store="memory://", topic_partitions=1,
                web_enabled=False, producer_acks=-1,
                # a killed worker's partitions are handed over after this, not after 60 s
                broker_session_timeout=10, broker_heartbeat_interval=1)
source = app.topic(in_topic, key_type=str, value_type=str, partitions=1)
sink = app.topic(out_topic, key_type=str, value_type=str, partitions=1)
counts = app.Table("counts", default=int, partitions=1)


@app.agent(source)
async def count(stream):
    async for key, _value in stream.items():
        counts[key] += 1
        await sink.send(key=key, value=str(counts[key]))


if __name__ == "__main__":
    # mode's Worker directly: Faust's click CLI is not used (see pyproject.toml).
    Worker(app, loglevel="WARNING").execute_from_commandline()
