"""Adapts encode requests to the image encoder and the encoder cache: images in the media store
in, their vision-tower outputs in the media store out, and the reply names how many rows each has.

    encode.<model fingerprint> (EncodeRequest, queue group "encoders") -> EncodeReply

Cached outputs are not computed again: a request's images found in the cache (or written by
another encoder meanwhile) are touched and answered at once. Requests are served one at a time on
one thread (the vision tower's forward), so the event loop stays free to answer heartbeats; a
request's new images run as one batch. At most ``max_queued_requests`` wait (past it: busy, a
503), and one that waited longer than its gateway does is not run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from safetensors import safe_open
from safetensors.torch import save as save_safetensors

from libs.bus.base import Bus, Message, Subscription
from libs.bus.membership import announce
from libs.kvstore.media_store import EMBEDS_TENSOR, MediaStore
from libs.protocol.codec import DecodeError, decode, encode
from libs.protocol.media_messages import EncodeReply, EncodeRequest
from libs.protocol.member_messages import MemberInfo, MemberKind
from libs.protocol.subjects import QUEUE_ENCODERS, Subjects
from services.encoder.config import Config
from services.encoder.encoder_cache import EncoderCache
from services.encoder.image_encoder import BadImage, ImageEncoder

log = logging.getLogger(__name__)


STALE_IMAGE_S = 3600.0  # an image file this old belongs to no request that will still be encoded


class _Failed(Exception):
    """An image of a request that cannot be decoded, or is not stored (which one, and why)."""

    def __init__(self, why: str, mm_hash: bytes, missing: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.mm_hash = mm_hash
        self.missing = missing


class EncoderService:
    def __init__(
        self, config: Config, bus: Bus, store: MediaStore, encoder: ImageEncoder, fingerprint: str
    ) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.subject_prefix)
        self.store = store
        self.encoder = encoder
        self.fingerprint = fingerprint
        self.cache = EncoderCache(int(config.encoder_cache_gb * (1 << 30)), config.encoder_cache_min_age_s)
        self.num_encoded = 0  # images run through the vision tower
        self.encode_s = 0.0  # the time those forwards took, in all
        self.num_queued = 0  # requests received, not answered yet
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="encode")
        self._sub: Subscription | None = None

    def load_cache(self) -> None:
        """What the store holds for this model already (an earlier run, another encoder), by the
        time each was last used; and image files no request will read any more, removed."""
        for mm_hash, used_at, _ in self.store.stored_embeds(self.fingerprint):
            stored = self._stored(mm_hash)
            if stored is not None:
                self.cache.insert(mm_hash, *stored, used_at)
                self.cache.touch(mm_hash, used_at)
        self._evict(time.time())
        stale = self.store.remove_stale_images(time.time() - STALE_IMAGE_S)
        log.info(
            "encoder cache: %d outputs, %.1f MiB; %d stale image files removed",
            len(self.cache),
            self.cache.num_bytes / (1 << 20),
            stale,
        )

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self.load_cache)
        subject = self.subjects.encode(self.fingerprint)
        self._sub = await self.bus.subscribe(subject, self.on_encode, queue=QUEUE_ENCODERS)
        log.info("encoder %s ready on %s", self.config.encoder_id, subject)
        info = MemberInfo(MemberKind.ENCODER, self.config.encoder_id)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(announce(self.bus, self.subjects.members_bucket, info, stop))
                tg.create_task(self._sweep_loop(stop))
        finally:
            await self._sub.unsubscribe()
            self._thread.shutdown(wait=True)

    async def _sweep_loop(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), STALE_IMAGE_S / 4)
            await loop.run_in_executor(
                self._thread, self.store.remove_stale_images, time.time() - STALE_IMAGE_S
            )

    async def on_encode(self, msg: Message) -> None:
        me = self.config.encoder_id
        try:
            req = decode(EncodeRequest, msg.data)
        except DecodeError as exc:
            await self.bus.respond(
                msg, encode(EncodeReply(encoder_id=me, error=f"bad encode request: {exc}"))
            )
            return
        if self.num_queued >= self.config.max_queued_requests:
            await self.bus.respond(msg, encode(EncodeReply(encoder_id=me, busy=True, error="queue full")))
            return
        self.num_queued += 1
        try:
            received = time.monotonic()
            reply = await asyncio.get_running_loop().run_in_executor(self._thread, self.handle, req, received)
        finally:
            self.num_queued -= 1
        await self.bus.respond(msg, encode(reply))

    def handle(self, req: EncodeRequest, received: float | None = None) -> EncodeReply:
        """The reply to one request (on the encode thread: the cache is this thread's alone)."""
        me = self.config.encoder_id
        if req.model_fingerprint != self.fingerprint:
            return EncodeReply(encoder_id=me, error=f"this encoder serves model {self.fingerprint}")
        if received is not None and req.timeout_s and time.monotonic() - received > req.timeout_s:
            return EncodeReply(encoder_id=me, busy=True, error="queued past the gateway's timeout")
        now = time.time()
        num_tokens = {h: n for h in req.mm_hashes if (n := self._cached(h, now)) is not None}
        num_cached = len(num_tokens)
        missing = [h for h in dict.fromkeys(req.mm_hashes) if h not in num_tokens]
        try:
            num_tokens.update(self._encode(missing, now))
        except _Failed as exc:
            index = req.mm_hashes.index(exc.mm_hash)
            if exc.missing:
                return EncodeReply(encoder_id=me, error=exc.why, missing_image=index)
            return EncodeReply(encoder_id=me, error=exc.why, bad_image=index)
        except Exception as exc:
            log.exception("encoding %d images failed", len(missing))
            return EncodeReply(encoder_id=me, error=f"the encoder failed: {exc!r}")
        self._evict(now)
        return EncodeReply(tuple(num_tokens[h] for h in req.mm_hashes), num_cached, me)

    def _cached(self, mm_hash: bytes, now: float) -> int | None:
        """Its rows when its output is stored (cached here, or written by another encoder), touched."""
        num_tokens = self.cache.lookup(mm_hash, now)
        if num_tokens is not None and not self.store.has_embeds(self.fingerprint, mm_hash):
            self.cache.remove(mm_hash)  # another encoder evicted it
            return None
        if num_tokens is None:
            stored = self._stored(mm_hash)  # another encoder's, since
            if stored is None:
                return None
            num_tokens, size = stored
            self.cache.insert(mm_hash, num_tokens, size, now)
        self.store.touch_embeds(self.fingerprint, mm_hash, now)  # other encoders see it used
        self.store.remove_image(mm_hash)  # the gateway stored it again: not needed
        return num_tokens

    def _stored(self, mm_hash: bytes) -> tuple[int, int] | None:
        """(rows, file size) of a stored output, or None (gone, or not one this version reads)."""
        path = self.store.embeds_path(self.fingerprint, mm_hash)
        try:
            with safe_open(str(path), framework="pt") as f:
                return int(f.get_slice(EMBEDS_TENSOR).get_shape()[0]), path.stat().st_size
        except Exception:  # safetensors raises its own untyped errors: it is encoded again
            return None

    def _encode(self, mm_hashes: list[bytes], now: float) -> dict[bytes, int]:
        """Run the images through the tower and store their outputs; their row counts by hash."""
        if not mm_hashes:
            return {}
        pixels = []
        for mm_hash in mm_hashes:
            try:
                pixels.append(self.encoder.pixel_values(self.store.read_image(mm_hash)))
            except FileNotFoundError:
                raise _Failed("the image is not in the media store", mm_hash, missing=True) from None
            except BadImage as exc:
                raise _Failed(str(exc), mm_hash) from None
        started = time.perf_counter()
        outputs = self.encoder.encode(pixels)
        self.encode_s += time.perf_counter() - started
        self.num_encoded += len(outputs)
        num_tokens: dict[bytes, int] = {}
        for mm_hash, embeds in zip(mm_hashes, outputs, strict=True):
            data = save_safetensors({EMBEDS_TENSOR: embeds})
            self.store.put_embeds(self.fingerprint, mm_hash, data)
            self.store.remove_image(mm_hash)
            self.cache.insert(mm_hash, embeds.shape[0], len(data), now)
            num_tokens[mm_hash] = embeds.shape[0]
        return num_tokens

    def _evict(self, now: float) -> None:
        """Back within the budget: remove the least recently used outputs, unless another encoder
        used one within the minimum age (its file's time), which then counts as used then."""
        for victim in self.cache.victims(now):
            used_at = self.store.embeds_used_at(self.fingerprint, victim)
            if used_at is not None and now - used_at < self.cache.min_age_s:
                self.cache.touch(victim, used_at)
            else:
                self.store.remove_embeds(self.fingerprint, victim)
                self.cache.remove(victim, evicted=True)
