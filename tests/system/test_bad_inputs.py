"""The bad-input table against the running stack: every route, odd ids, bad headers and bodies.

No 5xx for any; each error in the API's own shape; the kept-alive connection makes a good request
right after each bad one without reconnecting; canary streams running beside them get their solo
answers; the worker is the same process at the end.
"""

from __future__ import annotations

import subprocess
from typing import Any

import httpx

from tests.system.bad_inputs import GOOD_BODY, GOOD_PATH, Case, all_cases, check_error_shape
from tests.system.canary import Canaries
from tests.system.stack import Stack


def worker_of(stack: Stack) -> subprocess.Popen[bytes]:
    (worker,) = [p for p in stack.procs if p.args[3] == "worker"]  # type: ignore[index]
    return worker


class Reconnects:
    """Counts new TCP connections an httpx client opens (its ``trace`` extension)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event_name: str, info: dict[str, Any]) -> None:
        self.count += event_name == "connection.connect_tcp.complete"


def answer_problems(client: httpx.Client, case: Case) -> list[str]:
    """What is wrong with the answer to ``case`` and with the good request right after it."""
    problems = []
    try:
        why = check_error_shape(case.send(client), case.shape)
    except httpx.HTTPError as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        problems.append(f"{case.name}: {why}")
    connects = Reconnects()
    try:
        good = client.post(GOOD_PATH, json=GOOD_BODY, extensions={"trace": connects})
        if good.status_code != 200:
            problems.append(f"after {case.name}: the good request got {good.status_code}: {good.text[:200]}")
    except httpx.HTTPError as exc:
        problems.append(f"after {case.name}: the good request failed: {type(exc).__name__}: {exc}")
    if connects.count:
        problems.append(f"after {case.name}: the connection was closed (the good request reconnected)")
    return problems


def run_cases(stack: Stack, cases: list[Case]) -> None:
    worker = worker_of(stack)
    pid = worker.pid
    problems: list[str] = []
    with Canaries(stack.base_url) as canaries, httpx.Client(base_url=stack.root_url, timeout=120) as client:
        client.get("/v1/models")  # open the connection every case then shares
        for case in cases:
            problems += answer_problems(client, case)
    print(f"{len(cases)} cases, {len(problems)} problems, {canaries.num_rounds} canary rounds")
    assert not problems, "\n".join(problems[:40])
    canaries.check()
    assert worker.poll() is None and worker_of(stack).pid == pid


def test_bad_inputs_are_4xx_in_the_apis_shape_and_hurt_nobody(stack: Stack) -> None:
    run_cases(stack, all_cases())
