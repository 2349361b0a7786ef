"""Random insert / touch / remove / expire / evict_for / lookup sequences against a plain-dict model.

After every operation the index's integrity holds and its entries equal the model's. Eviction is
checked against ``retention.eviction_key`` directly: victims come in key order, every block left
in the tier sorts at or after the last victim, the tier fits afterwards, and no victim was taken
beyond what the space needed (all expired blocks go regardless). The clock mostly moves forward,
but events may arrive a little late (``now`` in the past), as bus events do.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from libs.kvstore.retention import RetentionClass, RetentionPolicy, eviction_key
from services.kvcache.index import BlockEntry, BlockIndex, Placement, Tier

POLICY = RetentionPolicy(
    [RetentionClass("agent", 30.0, 0), RetentionClass("chat", 70.0, 1), RetentionClass("batch", 10.0, 0)]
)
hashes = st.integers(0, 11).map(lambda i: i.to_bytes(32, "big"))
tiers = st.sampled_from(list(Tier))
classes = st.sampled_from([None, "agent", "chat", "batch"])
lateness = st.sampled_from([0.0, 0.0, 0.0, 1.0, 5.0])


@dataclass
class Model:
    tier: Tier
    size: int
    cls: str
    last_use: float
    expires_at: float


def as_model(e: BlockEntry) -> Model:
    return Model(e.placement.tier, e.placement.size_bytes, e.retention_class, e.last_use, e.expires_at)


def key(e: BlockEntry, now: float) -> tuple[bool, int, float]:
    return eviction_key(e.expires_at, POLICY.get(e.retention_class).priority, e.last_use, now)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex(POLICY)
        self.model: dict[bytes, Model] = {}
        self.now = 1_000.0

    def merge(self, block_hash: bytes, new: Model) -> None:
        old = self.model.get(block_hash)
        if old is not None:
            stronger = POLICY.get(new.cls).priority > POLICY.get(old.cls).priority
            new.cls = new.cls if stronger else old.cls
            new.last_use = max(new.last_use, old.last_use)
            new.expires_at = max(new.expires_at, old.expires_at)
        self.model[block_hash] = new

    @rule(block_hash=hashes, tier=tiers, size=st.integers(0, 50), cls=classes, late=lateness)
    def insert(self, block_hash: bytes, tier: Tier, size: int, cls: str | None, late: float) -> None:
        now = self.now - late
        c = POLICY.get(cls) if cls else POLICY.default
        self.index.insert(block_hash, Placement(tier, f"loc-{size}", size, "fp"), now, cls)
        self.merge(block_hash, Model(tier, size, c.name, now, c.expires_at(now)))

    @rule(block_hash=hashes, cls=classes, late=lateness)
    def touch(self, block_hash: bytes, cls: str | None, late: float) -> None:
        now = self.now - late
        entry = self.index.touch(block_hash, now, cls)
        old = self.model.get(block_hash)
        assert (entry is None) == (old is None)
        if old is not None:
            c = POLICY.get(cls or old.cls)
            self.merge(block_hash, Model(old.tier, old.size, c.name, now, c.expires_at(now)))

    @rule(block_hash=hashes)
    def remove(self, block_hash: bytes) -> None:
        removed = self.index.remove(block_hash)
        assert (removed is None) == (self.model.pop(block_hash, None) is None)

    @rule(dt=st.sampled_from([0.0, 1.0, 5.0, 10.0]) | st.floats(0.0, 25.0))  # whole steps hit deadlines
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(tier=st.none() | tiers)
    def expire(self, tier: Tier | None) -> None:
        want = {
            k for k, m in self.model.items() if m.expires_at <= self.now and (tier is None or m.tier is tier)
        }
        got = self.index.expire(self.now, tier)
        assert {e.block_hash for e in got} == want and len(got) == len(want)
        for k in want:
            del self.model[k]

    @rule(tier=tiers, needed=st.integers(0, 60), slack=st.integers(0, 200))
    def evict_for(self, tier: Tier, needed: int, slack: int) -> None:
        capacity = needed + slack
        before = list(self.index.entries(tier))
        victims = self.index.evict_for(needed, capacity, self.now, tier)
        keys = [key(e, self.now) for e in victims]
        assert keys == sorted(keys), "victims out of policy order"
        victim_hashes = {e.block_hash for e in victims}
        kept = [e for e in before if e.block_hash not in victim_hashes]
        assert len(victim_hashes) == len(victims) and len(kept) + len(victims) == len(before)
        assert all(not e.expires_at <= self.now for e in kept), "an expired block survived"
        if victims:
            assert all(key(e, self.now) >= keys[-1] for e in kept), "a better victim was kept"
        num_bytes = sum(e.placement.size_bytes for e in kept)
        assert self.index.num_bytes(tier) == num_bytes and num_bytes + needed <= capacity
        last = victims[-1] if victims else None
        if last is not None and last.expires_at > self.now:  # it was needed to make room
            assert num_bytes + last.placement.size_bytes + needed > capacity
        for e in victims:
            assert e.placement.tier is tier
            del self.model[e.block_hash]

    @rule(prefix=st.lists(hashes, max_size=6), with_now=st.booleans())
    def lookup(self, prefix: list[bytes], with_now: bool) -> None:
        now = self.now if with_now else None
        found = self.index.lookup_longest_prefix(prefix, now)
        n = 0
        while n < len(prefix) and prefix[n] in self.model:
            if now is not None and self.model[prefix[n]].expires_at <= now:
                break
            n += 1
        assert [e.block_hash for e in found] == prefix[:n]

    @invariant()
    def agrees_with_model(self) -> None:
        self.index.check_integrity()
        got = {e.block_hash: as_model(e) for e in self.index.entries()}
        assert got == self.model


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestIndexMachine = IndexMachine.TestCase
