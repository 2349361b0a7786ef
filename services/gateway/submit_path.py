"""Where a new request's submit goes: the replica the KV router picks, else any that can take it.

The router names a worker and its owner among the schedulers live in the gateway's members view
(a scheduler just killed still owns its workers until they let it go). A named replica that no
longer answers, or has no room or worker, is left out and the router asked again. Without a
route the submit goes to the ``schedulers`` queue group; a replica there with no worker (one just
restarted, before it claims any) answers ``NO_WORKERS``, and then each live replica that drives a
worker is named in turn, so a client sees 503 only when no replica can take the request (and 429
when the one the queue group picked is full).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from libs.bus.base import Bus, NoResponders
from libs.protocol.codec import decode, encode
from libs.protocol.member_messages import MemberInfo
from libs.protocol.messages import SubmitReply, SubmitRequest, SubmitStatus
from libs.protocol.subjects import Subjects
from services.gateway.routing import RouterFeed

MAX_ROUTED_TRIES = 3  # replicas the router may name for one submit before the queue group


async def send_submit(
    bus: Bus,
    subjects: Subjects,
    req: SubmitRequest,
    prompt: Sequence[int],
    router: RouterFeed | None,
    schedulers: Callable[[], list[MemberInfo]],
    timeout_s: float,
) -> SubmitReply:
    """The reply of the scheduler that took ``req``, or the last refusal. Raises NoResponders
    when no scheduler answers at all, and RequestTimeout when the one asked does not reply."""
    tried: set[str] = set()
    if router is not None:
        live = {m.member_id for m in schedulers()}
        for _ in range(MAX_ROUTED_TRIES):
            route = await router.route(prompt, req.tenant, live - tried, req.image_spans)
            if route is None:
                break
            tried.add(route.scheduler_id)
            routed = dataclasses.replace(req, worker_id=route.worker_id)
            reply = await _ask(bus, subjects.submit_to(route.scheduler_id), routed, timeout_s)
            if reply is not None and reply.status not in (SubmitStatus.NO_WORKERS, SubmitStatus.QUEUE_FULL):
                return reply
    reply = await _ask(bus, subjects.submit, req, timeout_s)
    if reply is None:
        raise NoResponders(subjects.submit)
    if reply.status is not SubmitStatus.NO_WORKERS:
        return reply
    for info in schedulers():
        if info.member_id in tried or info.num_workers == 0 or info.member_id == reply.scheduler_id:
            continue
        tried.add(info.member_id)
        named = await _ask(bus, subjects.submit_to(info.member_id), req, timeout_s)
        if named is not None and named.status is not SubmitStatus.NO_WORKERS:
            return named
    return reply


async def _ask(bus: Bus, subject: str, req: SubmitRequest, timeout_s: float) -> SubmitReply | None:
    """One scheduler's (or the queue group's) reply; None when nothing answers there."""
    try:
        raw = await bus.request(subject, encode(req), timeout_s)
    except NoResponders:
        return None
    return decode(SubmitReply, raw)
