"""Subject, stream and bucket names: the one place they are spelled."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Subjects:
    """All names for one deployment; ``prefix`` lets several deployments share one NATS."""

    prefix: str = "deepinfer"

    @property
    def submit(self) -> str:
        return f"{self.prefix}.submit"

    def submit_to(self, scheduler_id: str) -> str:
        """Submit to one scheduler replica: the gateway's KV router picked it (and a worker)."""
        return f"{self.prefix}.submit.{scheduler_id}"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}.cancel"

    def out(self, gateway_id: str) -> str:
        return f"{self.prefix}.out.{gateway_id}"

    @property
    def out_all(self) -> str:
        return f"{self.prefix}.out.>"

    def worker_step(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{worker_id}.step"

    def load(self, worker_id: str) -> str:
        return f"{self.prefix}.load.{worker_id}"

    @property
    def load_all(self) -> str:
        return f"{self.prefix}.load.*"

    @property
    def kv_events(self) -> str:
        return f"{self.prefix}.kv.events"

    @property
    def kv_lookup(self) -> str:
        return f"{self.prefix}.kv.lookup"

    @property
    def kv_device_events(self) -> str:
        """KVEvents of each worker's G1, from the scheduler driving it (for the gateways' routers;
        a subject of its own, so the consumers of ``kv_events`` never see them)."""
        return f"{self.prefix}.kv.device_events"

    def kv_dump(self, publisher_id: str) -> str:
        """Request/reply: a worker's whole G2 content (a consumer of its events saw a gap)."""
        return f"{self.prefix}.kv.dump.{publisher_id}"

    def stats(self, kind: str, publisher_id: str) -> str:
        """Periodic KVCacheStats of one service, for the gateways' /metrics."""
        return f"{self.prefix}.stats.{kind}.{publisher_id}"

    @property
    def stats_all(self) -> str:
        return f"{self.prefix}.stats.>"

    @property
    def out_stream(self) -> str:
        """JetStream stream holding every gateway's step outputs (stream names allow no dots)."""
        return f"{self.prefix.replace('.', '_').upper()}_OUT"

    @property
    def resume_claim(self) -> str:
        """A gateway resuming a stream tells the others: do not cancel it on the old disconnect."""
        return f"{self.prefix}.resume.claim"

    @property
    def streams_bucket(self) -> str:
        """JetStream KV bucket: per request, what it takes to re-render its stream (a resume)."""
        return f"{self.prefix.replace('.', '-')}-streams"

    @property
    def responses_bucket(self) -> str:
        """JetStream KV bucket: stored Responses API objects (retrieval, previous_response_id)."""
        return f"{self.prefix.replace('.', '-')}-responses"

    @property
    def members_bucket(self) -> str:
        """JetStream KV bucket for membership and liveness."""
        return f"{self.prefix.replace('.', '-')}-members"

    def encode(self, model_fingerprint: str) -> str:
        """EncodeRequest, to one encoder of that model (queue group ``QUEUE_ENCODERS``)."""
        return f"{self.prefix}.encode.{model_fingerprint}"

    @property
    def pause(self) -> str:
        """PauseRequest: a stream's client left (pause its request), or it is resumed (go on)."""
        return f"{self.prefix}.pause"


# Queue group of the schedulers: each submit goes to exactly one of them.
QUEUE_SCHEDULERS = "schedulers"
# Queue group of the encoders: each encode request goes to one of a model's encoders.
QUEUE_ENCODERS = "encoders"
