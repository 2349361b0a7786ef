"""Which schedulers a gateway's requests have lost, and what happens to those requests.

A scheduler is lost when it is gone from the members view: not live there, and either seen live
before or silent since it took a request (a scheduler answers submits a moment before its first
heartbeat). Its requests move to another scheduler (``Migrations``). A scheduler whose last
outputs never arrived (``OutNumbering``), or whose numbering has a gap, fails its requests.
"""

from __future__ import annotations

import logging
import time

from libs.bus.membership import MEMBER_TTL_S, MembershipView
from libs.protocol.member_messages import MemberKind
from libs.protocol.messages import SchedulerRef
from services.gateway.migration import Migrations
from services.gateway.out_numbering import OutNumbering
from services.gateway.request_stream import Pending

log = logging.getLogger(__name__)


class SchedulerWatch:
    """Over the gateway's live requests (``pending``, by request id) and resumed ones (``replays``),
    both the gateway's own collections, read at each check."""

    def __init__(
        self,
        members: MembershipView,
        numbering: OutNumbering,
        migrations: Migrations,
        pending: dict[str, Pending],
        replays: set[Pending],
    ) -> None:
        self.members = members
        self.numbering = numbering
        self.migrations = migrations
        self.pending = pending
        self.replays = replays
        # Failing a scheduler's requests wants a surer verdict than readiness (/health goes 503 at
        # the view's own silence): twice the TTL, and its streams still end well inside 30 s.
        self.loss_s = 2 * MEMBER_TTL_S
        self._seen: set[SchedulerRef] = set()  # ever live in the view

    def live(self) -> list[SchedulerRef]:
        live = self.members.live(MemberKind.SCHEDULER)
        return sorted((SchedulerRef(m.member_id, m.incarnation) for m in live), key=lambda s: s.scheduler_id)

    def on_members(self) -> None:
        """After a current read of the members: move the requests of schedulers that are gone."""
        infos = self.members.live(MemberKind.SCHEDULER, silence_s=self.loss_s)
        live = {SchedulerRef(m.member_id, m.incarnation) for m in infos}
        self._seen |= live
        now = time.monotonic()
        self._check_arrivals(now)

        def gone(pending: Pending) -> bool:
            # (a scheduler restarted under its id is another process: the old one is gone)
            scheduler = pending.scheduler
            if scheduler is None or scheduler in live:
                return False
            return scheduler in self._seen or now - pending.accepted_at > self.loss_s

        self.migrations.on_schedulers([*self.pending.values(), *self.replays], gone, now)

    def fail(self, scheduler: SchedulerRef, why: str) -> None:
        log.error("scheduler %s: %s", scheduler.scheduler_id, why)
        for pending in self.pending.values():
            if pending.scheduler == scheduler and scheduler not in pending.lost_schedulers:
                pending.fail(why)  # (one being moved off it has lost nothing more)

    def _check_arrivals(self, now: float) -> None:
        """Fail the requests of a scheduler whose last outputs never came (see ``OutNumbering``)."""
        for scheduler, sent, since in self.numbering.behind(self.members.live(MemberKind.SCHEDULER), now):
            scheduler_id = scheduler.scheduler_id
            lost = [
                p
                for p in self.pending.values()
                if p.accepted_at < since and p.scheduler == scheduler and not (p.moving or p.failed)
            ]
            if lost:  # those taken later had nothing in the missing outputs
                log.error("scheduler %s: step outputs up to %d never arrived", scheduler_id, sent)
            for pending in lost:
                pending.fail(f"lost step outputs of scheduler {scheduler_id} (up to {sent})")
