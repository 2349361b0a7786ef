"""``deepinfer health --kind worker``: exit 0 when a live member of that kind is in the members
bucket, 1 when none is (or NATS does not answer in time). The compose healthcheck of the services
without an HTTP port (scheduler, worker, kvcache); it reads ``DEEPINFER_NATS_URL`` like they do.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass, field

from libs.bus.membership import live_members
from libs.bus.nats_auth import NatsConfig
from libs.bus.nats_bus import NatsBus
from libs.protocol.member_messages import MemberKind
from libs.protocol.subjects import Subjects
from libs.runtime.settings import build_config

KINDS = tuple(kind.name.lower() for kind in MemberKind)


@dataclass(frozen=True, slots=True)
class Config(NatsConfig):
    subject_prefix: str = field(default="deepinfer", metadata={"help": "prefix of every subject"})
    kind: str = field(
        default="worker", metadata={"help": f"the member kind to look for: {' | '.join(KINDS)}"}
    )
    member_id: str = field(default="", metadata={"help": "this member only ('': any of the kind)"})
    timeout_s: float = field(default=3.0, metadata={"help": "how long the check may take"})

    def __post_init__(self) -> None:
        NatsConfig.__post_init__(self)  # (slots: no zero-argument super())
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


async def live_ids(config: Config) -> list[str]:
    """The ids of the live members of ``config.kind``."""
    bus = await NatsBus.connect(config.nats_url, name="deepinfer-health", auth=config.nats_auth)
    try:
        members = await live_members(
            bus, Subjects(config.subject_prefix).members_bucket, MemberKind[config.kind.upper()]
        )
        return [m.member_id for m in members]
    finally:
        await bus.close()


def main(args: argparse.Namespace) -> None:
    config = build_config(Config, args, os.environ)
    try:
        ids = asyncio.run(asyncio.wait_for(live_ids(config), config.timeout_s))
    except Exception as exc:  # any failure to ask is an unhealthy answer, not a traceback
        print(f"unhealthy: no answer from {config.nats_url}: {exc!r}", file=sys.stderr)
        sys.exit(1)
    found = [i for i in ids if config.member_id in ("", i)]
    if not found:
        wanted = config.member_id or f"any {config.kind}"
        print(f"unhealthy: {wanted} is not a live member (live {config.kind}s: {ids})", file=sys.stderr)
        sys.exit(1)
    print(f"healthy: {config.kind} {', '.join(found)}")
