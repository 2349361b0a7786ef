"""A service's Prometheus /metrics on a port of its own (``--metrics-port``; 0: not served).

prometheus_client's HTTP server runs in a daemon thread, so a scrape is answered while the event
loop is busy (a long step, a GC pass) and never holds the loop up.
"""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0") -> WSGIServer | None:
    """Serve ``registry`` at ``http://addr:port/metrics``; None (nothing served) when ``port`` is 0.
    All interfaces by default: a scraper runs on another host or container. A taken port raises."""
    if port == 0:
        return None
    server, _ = start_http_server(port, addr, registry=registry)
    log.info("metrics on http://%s:%d/metrics", addr, port)
    return server
