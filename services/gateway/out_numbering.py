"""Each scheduler numbers the step outputs it sends one gateway (``StepOutputs.seq``, +1 per
message): what this gateway tracks of that numbering to notice a lost message. Pure: no nats,
asyncio or torch.

Two ways a loss shows: a gap (message N+2 after N), or a heartbeat that says more was sent than
ever arrived, for ``lag_s`` (the lost message was the last one, and nothing follows to show a gap).
"""

from __future__ import annotations

from collections.abc import Iterable

from libs.protocol.member_messages import MemberInfo
from libs.protocol.messages import SchedulerRef

LAG_S = 10.0  # outputs a heartbeat says were sent but that have not arrived this long after are lost


class OutNumbering:
    def __init__(self, gateway_id: str, lag_s: float = LAG_S) -> None:
        self.gateway_id = gateway_id
        self.lag_s = lag_s
        # Per scheduler process (a restart under the same id numbers afresh):
        self._last: dict[SchedulerRef, int] = {}  # the last StepOutputs.seq seen or said
        self._behind_since: dict[SchedulerRef, float] = {}  # since when its heartbeat said it
        # sent more than has arrived here

    def accepted(self, scheduler: SchedulerRef, out_seq: int) -> None:
        """A submit's reply: the scheduler had sent ``out_seq`` (-1: not said); outputs seen
        since are newer; if none, the next is ``out_seq`` + 1."""
        if out_seq >= 0:
            self._last.setdefault(scheduler, out_seq)

    def arrived(self, scheduler: SchedulerRef, seq: int) -> str:
        """A message arrived: what was lost before it ("" if nothing)."""
        last = self._last.get(scheduler)
        # Not older than what was seen or said: a submit's reply may overtake an output the
        # scheduler had published before it accepted.
        if last is None or seq > last:
            self._last[scheduler] = seq
        if last is not None and seq > last + 1:
            return f"lost step outputs {last + 1}..{seq - 1}"
        return ""

    def behind(self, schedulers: Iterable[MemberInfo], now: float) -> list[tuple[SchedulerRef, int, float]]:
        """(scheduler, what it says it sent, since when) for each scheduler whose heartbeat has
        said for ``lag_s`` that it sent more than arrived."""
        late = []
        for info in schedulers:
            scheduler = SchedulerRef(info.member_id, info.incarnation)
            sent = next((o.seq for o in info.out_seqs if o.gateway_id == self.gateway_id), 0)
            last = self._last.get(scheduler)
            if last is None or last >= sent:  # None: nothing since the start or an outage
                self._behind_since.pop(scheduler, None)
                continue
            since = self._behind_since.setdefault(scheduler, now)
            if now - since >= self.lag_s:
                late.append((scheduler, sent, since))
        return late

    def clear(self) -> None:
        """After a connection loss: each scheduler's next message starts its numbering afresh."""
        self._last.clear()
        self._behind_since.clear()

    def check_integrity(self) -> None:
        assert all(seq >= 0 for seq in self._last.values())
        assert set(self._behind_since) <= set(self._last)
