"""Adapts encode requests to the image encoder and the encoder cache: images in the media store
in, their vision-tower outputs in the media store out, and the reply names how many rows each has.

    encode.<model fingerprint> (EncodeRequest, queue group "encoders") -> EncodeReply

Cached outputs are not computed again: a request's images found in the cache are touched and
answered at once. Requests are served one at a time on one thread (the vision tower's forward),
so the event loop stays free to answer heartbeats; a request's new images run as one batch.
"""

from __future__ import annotations

import asyncio
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


class _Failed(Exception):
    """An image of a request that cannot be decoded (which one, and why)."""

    def __init__(self, why: str, mm_hash: bytes) -> None:
        super().__init__(why)
        self.why = why
        self.mm_hash = mm_hash


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
        self.cache = EncoderCache(int(config.encoder_cache_gb * (1 << 30)))
        self.num_encoded = 0  # images run through the vision tower
        self.encode_s = 0.0  # the time those forwards took, in all
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="encode")
        self._sub: Subscription | None = None

    def load_cache(self) -> None:
        """What the store holds for this model already (an earlier run, another encoder), oldest first."""
        found = sorted(self.store.stored_embeds(self.fingerprint), key=lambda entry: entry[1])
        for mm_hash, _, size in found:
            try:
                path = self.store.embeds_path(self.fingerprint, mm_hash)
                with safe_open(str(path), framework="pt") as f:
                    num_tokens = f.get_slice(EMBEDS_TENSOR).get_shape()[0]
            except Exception:  # not an output this version reads: it gets rewritten when asked
                continue
            for victim in self.cache.insert(mm_hash, num_tokens, size):
                self.store.remove_embeds(self.fingerprint, victim)
        log.info("encoder cache: %d outputs, %.1f MiB", len(self.cache), self.cache.num_bytes / (1 << 20))

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self.load_cache)
        subject = self.subjects.encode(self.fingerprint)
        self._sub = await self.bus.subscribe(subject, self.on_encode, queue=QUEUE_ENCODERS)
        log.info("encoder %s ready on %s", self.config.encoder_id, subject)
        info = MemberInfo(MemberKind.ENCODER, self.config.encoder_id)
        try:
            await announce(self.bus, self.subjects.members_bucket, info, stop)
        finally:
            await self._sub.unsubscribe()
            self._thread.shutdown(wait=True)

    async def on_encode(self, msg: Message) -> None:
        try:
            req = decode(EncodeRequest, msg.data)
        except DecodeError as exc:
            reply = EncodeReply(encoder_id=self.config.encoder_id, error=f"bad encode request: {exc}")
        else:
            loop = asyncio.get_running_loop()
            reply = await loop.run_in_executor(self._thread, self.handle, req)
        await self.bus.respond(msg, encode(reply))

    def handle(self, req: EncodeRequest) -> EncodeReply:
        """The reply to one request (on the encode thread: the cache is this thread's alone)."""
        me = self.config.encoder_id
        if req.model_fingerprint != self.fingerprint:
            return EncodeReply(encoder_id=me, error=f"this encoder serves model {self.fingerprint}")
        num_tokens: dict[bytes, int] = {}
        for mm_hash in req.mm_hashes:
            cached = self.cache.lookup(mm_hash)
            if cached is not None and self.store.has_embeds(self.fingerprint, mm_hash):
                num_tokens[mm_hash] = cached
                self.store.remove_image(mm_hash)  # the gateway stored it again: not needed
            elif cached is not None:
                self.cache.remove(mm_hash)  # its file is gone (another encoder evicted it)
        num_cached = len(num_tokens)
        missing = [h for h in dict.fromkeys(req.mm_hashes) if h not in num_tokens]
        try:
            num_tokens.update(self._encode(missing))
        except _Failed as exc:
            return EncodeReply(encoder_id=me, error=exc.why, bad_image=req.mm_hashes.index(exc.mm_hash))
        except FileNotFoundError:
            why = "an image is not in the media store (is it shared with the gateways?)"
            return EncodeReply(encoder_id=me, error=why)
        except Exception as exc:
            log.exception("encoding %d images failed", len(missing))
            return EncodeReply(encoder_id=me, error=f"the encoder failed: {exc!r}")
        return EncodeReply(tuple(num_tokens[h] for h in req.mm_hashes), num_cached, me)

    def _encode(self, mm_hashes: list[bytes]) -> dict[bytes, int]:
        """Run the images through the tower and store their outputs; their row counts by hash."""
        if not mm_hashes:
            return {}
        pixels = []
        for mm_hash in mm_hashes:
            try:
                pixels.append(self.encoder.pixel_values(self.store.read_image(mm_hash)))
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
            for victim in self.cache.insert(mm_hash, embeds.shape[0], len(data)):
                self.store.remove_embeds(self.fingerprint, victim)
            num_tokens[mm_hash] = embeds.shape[0]
        return num_tokens
