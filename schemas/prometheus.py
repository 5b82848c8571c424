"""Every long-running process's Prometheus endpoint: one HTTP server on the port its settings name.

The port convention, the same for every component's `metrics_port` setting (`MetricsPort`):
None serves nothing (the default, so a process started by hand opens no port it was not asked
for); 0 lets the operating system pick a free port, as binding a socket to port 0 always does; any
other number is that port. `rollstream up` gives each of its processes a free port of its own and
lists them in `runs/<run>/logs/metrics_urls.json`.

The address convention, every component's `metrics_host` setting (`MetricsHost`): loopback, 127.0.0.1,
by default, so a process opens nothing another host can reach unless it is asked to; 0.0.0.0 (or "::")
serves every interface, for a scraper on another host (a Kubernetes pod's Prometheus, deploy/k8s/).
The URL a process announces is one it can be reached at: a wildcard address is no address to connect to,
so it announces the loopback (`reachable_host`).

The metrics are declared next to the code that updates them, registered nowhere (`registry=None`),
each module listing its own in a tuple PROMETHEUS (learner/process.py, streams/app.py,
streams/aggregator_agent.py, streams/batcher_agent.py, env_workers/worker.py,
pipeline/dispatch/dispatcher.py, pipeline/engine/heartbeat.py). A process serves a registry of its
own with just those (`process_registry`): the `rollstream` command imports every component's
modules, so prometheus_client's default registry would show the other components' metrics too, at 0.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from collections.abc import Iterable
from typing import Annotated

from prometheus_client import GCCollector, PlatformCollector, ProcessCollector, start_http_server
from prometheus_client.registry import Collector, CollectorRegistry
from pydantic import AfterValidator, Field

MetricsPort = Annotated[int | None, Field(ge=0, le=65535)]
"""A process's `metrics_port`: None none, 0 any free port, else that port."""

_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _bind_address(host: str) -> str:
    """`host` when it is an IP address or a host name a server can bind; a ValueError otherwise (a URL, a
    host:port, an empty string, which Python's sockets would take as every address)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if len(host) > 253 or not _HOSTNAME.fullmatch(host):
            raise ValueError(f"not an IP address or host name to serve metrics on: {host!r}") from None
    return host


MetricsHost = Annotated[str, AfterValidator(_bind_address)]
"""A process's `metrics_host`: the address its /metrics binds, an IP address or host name."""


def reachable_host(host: str) -> str:
    """The address a server bound to `host` is reached at from its own machine: the loopback of the same
    family for a wildcard address (0.0.0.0 -> 127.0.0.1, :: -> ::1), `host` itself otherwise."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if not address.is_unspecified:
        return host
    return "127.0.0.1" if address.version == 4 else "::1"


def metrics_url(port: int, host: str = "127.0.0.1") -> str:
    """The /metrics URL at `host` (an IPv6 address in brackets, as URLs write it)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def metrics_line(process: str, url: str) -> str:
    """How a process's endpoint is announced, by the process itself and by `rollstream up`."""
    return f"metrics: {process} {url}"


def process_registry(metrics: Iterable[Collector]) -> CollectorRegistry:
    """A registry of these metrics and the process's own figures (CPU, memory, file descriptors,
    garbage collection), as prometheus_client's default registry has them."""
    registry = CollectorRegistry()
    for metric in metrics:
        registry.register(metric)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def serve_metrics(port: int | None, process: str, metrics: Iterable[Collector], *,
                  host: str = "127.0.0.1") -> int | None:
    """Serves `metrics` (`process_registry`) at http://HOST:PORT/metrics from a daemon thread; returns the
    port it listens on, or None when `port` is None or cannot be bound. A port that cannot be bound is
    said on stderr and the process goes on without metrics: training must not stop for its observability.
    The URL said on stderr is one to connect to: the loopback when `host` is a wildcard (`reachable_host`)."""
    if port is None:
        return None
    try:
        server, _ = start_http_server(port, addr=host, registry=process_registry(metrics))
    except OSError as error:
        print(f"metrics: {process} not served, port {port} on {host}: {error.strerror or error}", file=sys.stderr,
              flush=True)
        return None
    actual = server.server_port
    # On stderr whatever the process's log level (a streams worker logs warnings only): its log says where.
    print(metrics_line(process, metrics_url(actual, reachable_host(host))), file=sys.stderr, flush=True)
    return actual
