"""The fault table: one real stack, faults applied in sequence (kill -9 of each service, SIGSTOP
of the worker, a nats-server restart), each while one stream per API is in flight, each followed
by bringing the hurt part back.

Required of each row: every in-flight stream ends, with its tokens or an error event, within
FAULT_BOUND_S of the fault (a killed gateway drops its connections instead, and the streams are
resumed whole from the next gateway); the stack serves a real request again after the part is
back; and at the end no process the harness started is left. The table is printed (pytest -s).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.system.faults import Faults, InFlight, Role, StreamEnd
from tests.system.stream_end import ApiName

FAULT_BOUND_S = 30.0
DEADLINE_S = 75.0  # a stream's whole read, start to end: past the bound, so a late end is measured
RESUME_DEADLINE_S = 240.0  # a resumed stream still generates: bounded, but by no speed
SERVE_TIMEOUT_S = 240.0
NUM_TOKENS_BEFORE = 3  # the fault comes mid-stream
MODEL = "SmolLM2-135M-Instruct"
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
MAX_TOKENS = 64  # a stream that a fault spares ends well inside the bound, even on a loaded machine
BODIES: dict[ApiName, dict[str, object]] = {
    "chat": {
        "model": MODEL,
        "messages": STORY,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    },
    "messages": {"model": MODEL, "messages": STORY, "max_tokens": MAX_TOKENS, "temperature": 0},
    "responses": {"model": MODEL, "input": STORY, "max_output_tokens": MAX_TOKENS, "temperature": 0},
}
ENDED = {"completed", "error_event"}
ROWS: list[str] = []


@pytest.fixture(scope="module")
def faults(model_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faults]:
    log = tmp_path_factory.mktemp("fault-table") / "stack.log"
    running = Faults.start(model_cache_dir, log)
    yield running
    running.close()
    table = "\n".join(["", f"fault table (stack log: {log})", *ROWS])
    print(table)
    log.with_name("fault-table.txt").write_text(table + "\n")


def in_flight(faults: Faults) -> dict[ApiName, InFlight]:
    faults.wait_serving(SERVE_TIMEOUT_S)  # the previous row's part is back
    streams = {api: faults.stream(api, body, DEADLINE_S) for api, body in BODIES.items()}
    for stream in streams.values():
        stream.wait_tokens(NUM_TOKENS_BEFORE, 60)
    return streams


def hurt(streams: dict[ApiName, InFlight], fault: Callable[[], None]) -> dict[ApiName, StreamEnd]:
    for stream in streams.values():
        stream.mark()  # seconds are counted from the fault
    fault()
    return {api: stream.result() for api, stream in streams.items()}


def serving_again(faults: Faults) -> float | None:
    """Seconds until a real request succeeds again; None if it never did (the row says so)."""
    try:
        return faults.wait_serving(SERVE_TIMEOUT_S)
    except TimeoutError:
        return None


def record(fault: str, ends: dict[ApiName, StreamEnd], serve_s: float | None) -> None:
    serving = "not serving" if serve_s is None else f"serving again {serve_s:5.1f} s after"
    for api, end in ends.items():
        ROWS.append(
            f"{fault:<22} {api:<9} {end.kind:<11} {end.seconds:5.1f} s {end.num_tokens:4d} tokens  "
            f"{serving}  | {end.detail[:160]}"
        )


def check_ended(ends: dict[ApiName, StreamEnd]) -> None:
    late = {api: end for api, end in ends.items() if end.kind not in ENDED or end.seconds > FAULT_BOUND_S}
    assert not late, f"streams that did not end within {FAULT_BOUND_S} s: {late}"


def kill_and_restart(faults: Faults, role: Role) -> None:
    streams = in_flight(faults)
    ends = hurt(streams, lambda: faults.kill9(role))
    faults.restart(role)
    serve_s = serving_again(faults)
    record(f"kill -9 {role}", ends, serve_s)
    check_ended(ends)
    assert serve_s is not None, f"not serving within {SERVE_TIMEOUT_S} s of the {role}'s restart"


@pytest.mark.parametrize("role", ["worker", "scheduler", "kvcache"])
def test_kill9(faults: Faults, role: Role) -> None:
    kill_and_restart(faults, role)


def test_kill9_gateway_drops_then_a_second_gateway_resumes(faults: Faults) -> None:
    streams = in_flight(faults)
    dropped = hurt(streams, lambda: faults.kill9("gateway"))
    faults.restart("gateway")  # same port: the client's URL still works
    serve_s = serving_again(faults)
    resumed, first_ids = {}, {}
    for api, stream in streams.items():
        assert stream.state.request_id is not None, api
        last = stream.state.last_event_id
        again = faults.resume(api, stream.state.request_id, last, RESUME_DEADLINE_S)
        resumed[api] = again.result()
        first_ids[api] = (last, again.state.first_event_id)
    record("kill -9 gateway", dropped, serve_s)
    record("  resumed at gateway 2", resumed, serve_s)
    assert serve_s is not None, f"not serving within {SERVE_TIMEOUT_S} s of the gateway's restart"
    assert all(end.kind == "dropped" for end in dropped.values()), dropped
    assert all(end.kind == "completed" for end in resumed.values()), resumed
    # Each resumed at the event after the last one its client saw: nothing lost, nothing repeated.
    assert all(first == last + 1 for last, first in first_ids.values()), first_ids


def test_sigstop_worker_then_sigcont(faults: Faults) -> None:
    streams = in_flight(faults)
    try:
        ends = hurt(streams, lambda: faults.stop("worker"))
    finally:
        faults.cont("worker")
    serve_s = serving_again(faults)
    record("SIGSTOP worker", ends, serve_s)
    check_ended(ends)
    assert serve_s is not None, f"not serving within {SERVE_TIMEOUT_S} s of SIGCONT"


def test_restart_nats_server(faults: Faults) -> None:
    streams = in_flight(faults)
    ends = hurt(streams, lambda: faults.restart("nats-server"))  # same port, same JetStream store
    serve_s = serving_again(faults)
    record("restart nats-server", ends, serve_s)
    check_ended(ends)
    assert serve_s is not None, f"not serving within {SERVE_TIMEOUT_S} s of the nats-server restart"


def test_nothing_left_running(faults: Faults) -> None:
    faults.close()
    assert faults.leftover_processes() == []
