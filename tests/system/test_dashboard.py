"""The gateway's /dashboard in headless Chromium (Debian's package) on the shared stack: the page
loads, polls /metrics, and shows what /metrics says.

Chromium runs the page in virtual time (``--virtual-time-budget``): its 2 s timers fire at once,
and virtual time stands still while a fetch is pending. The page is loaded through a pass-through
proxy to the gateway, which holds one of the page's polls of /metrics until a chat completion has
ended: that request's tokens land between two polls exactly 2 virtual seconds apart, so the page's
output tokens/s for that interval is known. The proxy keeps every /metrics body it passed on; each
number the page shows must equal the same selector evaluated (here, independently of the page's
parser) on the last body the page saw, and the traffic counters must equal a scrape taken after.
"""

from __future__ import annotations

import html.parser
import math
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.system.stack import Stack

MODEL = "SmolLM2-135M-Instruct"
POLL_S = 2.0  # the page's poll period
# Polls at 0, 2, 4, 6, 8 and 10 virtual seconds; the DOM is dumped at 11, between two polls.
BUDGET_MS = 11_000
NUM_POLLS = 6
HELD_POLL = 3  # this poll of /metrics is answered once the mid-run request has ended
MISSING = "\u2014"
# Every number the page must show (its source, as the page's data-metric names it).
REQUIRED = {
    "output-tokens-per-s": "sum(rate(deepinfer_generation_tokens_total))",
    "requests-per-s": "sum(rate(deepinfer_requests_total))",
    "requests-total": "sum(deepinfer_requests_total)",
    "requests-outcome-ok": 'sum(deepinfer_requests_total{outcome="ok"})',
    "prompt-tokens-total": "sum(deepinfer_prompt_tokens_total)",
    "cached-prompt-tokens-total": "sum(deepinfer_cached_prompt_tokens_total)",
    "output-tokens-total": "sum(deepinfer_generation_tokens_total)",
    "requests-in-flight": "sum(deepinfer_requests_in_flight)",
    "gateway-requests-in-flight": "sum(deepinfer_gateway_requests_in_flight)",
    "workers-total": "sum(deepinfer_workers)",
    "revenue-total": "sum(deepinfer_revenue_dollars_total)",
    "revenue-kind-input_uncached": 'sum(deepinfer_revenue_dollars_total{kind="input_uncached"})',
    "revenue-kind-input_cached": 'sum(deepinfer_revenue_dollars_total{kind="input_cached"})',
    "revenue-kind-output": 'sum(deepinfer_revenue_dollars_total{kind="output"})',
    "device-seconds-total": "sum(deepinfer_device_seconds_total)",
    "revenue-per-device-hour": "deepinfer_revenue_per_device_hour_dollars",
    "rental-per-device-hour": "deepinfer_rental_per_device_hour_dollars",
    "gross-margin": "deepinfer_gross_margin_ratio",
}
# Changed only by requests ending: equal on a scrape after the page's last poll (device time and
# what is derived from it grow by the second, the KV stats come on their publishers' period).
TRAFFIC_COUNTERS = (
    "deepinfer_requests_total",
    "deepinfer_prompt_tokens_total",
    "deepinfer_cached_prompt_tokens_total",
    "deepinfer_generation_tokens_total",
    "deepinfer_revenue_dollars_total",
)
_SELECTOR = re.compile(r"(sum\()?([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\)?")
_LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    return path


def chat(base_url: str, prompt: str) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12}
    resp = httpx.post(f"{base_url}/chat/completions", json={**body, "temperature": 0}, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


# ---------------------------------------------------------------- the values /metrics holds


@dataclass
class Scrape:
    declared: set[str]  # every family, counters by their sample name (``*_total``) too
    samples: list[tuple[str, dict[str, str], float]]


def parse(text: str) -> Scrape:
    scrape = Scrape(set(), [])
    for family in text_string_to_metric_families(text):
        scrape.declared |= (
            {family.name, f"{family.name}_total"} if family.type == "counter" else {family.name}
        )
        scrape.samples += [(s.name, s.labels, s.value) for s in family.samples]
    return scrape


def evaluate(scrape: Scrape, metric: str) -> float | None:
    """``sum(name{l="v"})``: the sum over the matching series (0 when the family has none, None
    when it is absent); ``name{l="v"}``: the first matching series; None for a non-finite value."""
    m = _SELECTOR.fullmatch(metric)
    assert m is not None, f"not a selector the test reads: {metric}"
    total, name = m.group(1) is not None, m.group(2)
    wanted = {k: re.sub(r"\\(.)", r"\1", v) for k, v in _LABEL.findall(m.group(3) or "")}
    values = [v for n, labels, v in scrape.samples if n == name and wanted.items() <= labels.items()]
    if total:
        value = sum(values) if values else (0.0 if name in scrape.declared else None)
    else:
        value = values[0] if values else None
    return value if value is not None and math.isfinite(value) else None


# ---------------------------------------------------------------- the page as Chromium left it


@dataclass
class Shown:
    metric: str
    value: float | None  # data-value: the raw number, absent when the page shows MISSING
    text: str
    attrs: dict[str, str] = field(default_factory=dict)


class ShownNumbers(html.parser.HTMLParser):
    """Every element with a data-metric (leaves: text only), by id, and the poll count."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: dict[str, Shown] = {}
        self.polls = ""
        self._open: tuple[str, str] | None = None  # (tag, id) being read

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "data-metric" in a:
            value = float(a["data-value"]) if "data-value" in a else None
            self.shown[a["id"]] = Shown(a["data-metric"], value, "", a)
            self._open = (tag, a["id"])
        elif a.get("id") == "poll-count":
            self._open = (tag, "poll-count")

    def handle_data(self, data: str) -> None:
        if self._open is None:
            return
        if self._open[1] == "poll-count":
            self.polls += data
        else:
            self.shown[self._open[1]].text += data

    def handle_endtag(self, tag: str) -> None:
        if self._open is not None and self._open[0] == tag:
            self._open = None


# ---------------------------------------------------------------- a pass-through to the gateway


@dataclass
class PassThrough:
    """Forwards GETs to the gateway; keeps each /metrics body; runs ``before_poll[n]`` before
    answering the n-th poll (1-based), and keeps what it raised."""

    gateway: str
    before_poll: dict[int, Callable[[], None]]
    bodies: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    def forward(self, path: str) -> httpx.Response:
        if path == "/metrics":
            hook = self.before_poll.get(len(self.bodies) + 1)
            try:
                if hook is not None:
                    hook()
            except BaseException as exc:  # reported by the test, not lost in the server's thread
                self.errors.append(exc)
        resp = httpx.get(self.gateway + path, timeout=60)
        if path == "/metrics":
            self.bodies.append(resp.text)
        return resp


@contextmanager
def serving(proxy: PassThrough) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            resp = proxy.forward(self.path)
            self.send_response(resp.status_code)
            for name in ("content-type", "content-security-policy", "cache-control"):
                if name in resp.headers:
                    self.send_header(name, resp.headers[name])
            self.send_header("content-length", str(len(resp.content)))
            self.end_headers()
            self.wfile.write(resp.content)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def wait_quiet(root_url: str, timeout_s: float = 60.0) -> None:
    """Until no request is in flight at the gateway (an earlier test's may still be ending)."""
    deadline = time.monotonic() + timeout_s
    names = ("deepinfer_requests_in_flight", "deepinfer_gateway_requests_in_flight")
    while True:
        scrape = parse(httpx.get(f"{root_url}/metrics", timeout=10).text)
        if all(evaluate(scrape, f"sum({name})") == 0 for name in names):
            return
        assert time.monotonic() < deadline, "requests still in flight at the gateway"
        time.sleep(0.5)


# ---------------------------------------------------------------- the test


def test_dashboard_shows_what_metrics_says(stack: Stack) -> None:
    browser = chromium()
    page = httpx.get(f"{stack.root_url}/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text), (
        "the page loads from elsewhere"
    )

    for prompt in ("Name a color.", "Say hi."):
        chat(stack.base_url, prompt)
    wait_quiet(stack.root_url)
    mid_run: list[dict[str, Any]] = []
    proxy = PassThrough(
        stack.root_url, {HELD_POLL: lambda: mid_run.append(chat(stack.base_url, "Count to 5."))}
    )
    with serving(proxy) as url:
        flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--dump-dom"]
        argv = [browser, *flags, f"--virtual-time-budget={BUDGET_MS}", f"{url}/dashboard"]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    after = parse(httpx.get(f"{stack.root_url}/metrics", timeout=10).text)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not proxy.errors, proxy.errors
    dom = ShownNumbers()
    dom.feed(run.stdout)
    assert "</html>" in run.stdout and dom.shown, run.stdout[-3000:]
    assert dom.polls == str(len(proxy.bodies)) == str(NUM_POLLS), (dom.polls, len(proxy.bodies))

    for element_id, metric in REQUIRED.items():
        assert element_id in dom.shown, f"the page shows no #{element_id}"
        assert dom.shown[element_id].metric == metric
    seen = parse(proxy.bodies[-1])  # what the page's last poll got
    for element_id, shown in dom.shown.items():
        assert not re.search(r"NaN|undefined|Infinity|null", shown.text), (element_id, shown.text)
        if shown.metric.startswith("sum(rate("):
            continue
        expected = evaluate(seen, shown.metric)
        if expected is None:
            assert shown.value is None and shown.text == MISSING, (element_id, shown.value, shown.text)
            continue
        assert shown.value == pytest.approx(expected, rel=1e-12), (element_id, shown.metric)
        if shown.attrs.get("data-format") == "count":
            assert shown.text.replace(",", "") == str(round(expected)), (element_id, shown.text)
        metric_name = _SELECTOR.fullmatch(shown.metric).group(2)  # type: ignore[union-attr]
        if metric_name in TRAFFIC_COUNTERS:
            assert shown.value == pytest.approx(evaluate(after, shown.metric), rel=1e-12), element_id

    assert dom.shown["output-tokens-total"].value  # the comparisons above were not all of zeros
    assert (dom.shown["requests-outcome-ok"].value or 0) >= 3
    assert dom.shown["requests-in-flight"].value == 0

    # Output tokens/s per interval between polls: the mid-run request's tokens over 2 s, else 0.
    assert len(mid_run) == 1
    history = [float(v) for v in dom.shown["output-tokens-per-s"].attrs["data-history"].split(",")]
    expected_rates = [0.0] * (NUM_POLLS - 1)
    expected_rates[HELD_POLL - 2] = mid_run[0]["usage"]["completion_tokens"] / POLL_S
    assert history == pytest.approx(expected_rates, rel=0.02), history
    assert dom.shown["requests-per-s"].value == 0  # none ended in the last interval
