"""A prompt's images, from the client's parts to encoded placeholder runs the scheduler can take.

Per image: its bytes (inline, or fetched from an allowed host), checked whole (Pillow decodes it:
a truncated or oversized file, or another format, is a 400 naming the part), stored in the media
store under their sha256, then sent by hash to an encoder of the model, which writes the vision
tower's output beside them. Each image slot the chat format wrote becomes the model's image
token ``num_image_tokens`` times (``libs/recipe/image_slots.py``), and an ``ImageSpan`` says which
image those positions hold.

Remote URLs are fetched only from the hosts of ``--image-url-hosts`` (none by default): a gateway
that fetches any URL a client names can be made to probe its own network (SSRF).
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
from PIL import Image, UnidentifiedImageError

from libs.bus.base import Bus, NoResponders, RequestTimeout
from libs.kvstore.media_store import MediaStore, image_hash
from libs.protocol.codec import DecodeError, decode, encode
from libs.protocol.media_messages import EncodeReply, EncodeRequest
from libs.protocol.subjects import Subjects
from libs.recipe.api.common import UNSUPPORTED_INPUT
from libs.recipe.conversation import ImageInput
from libs.recipe.fields import ApiError
from libs.recipe.image_slots import expand_image_slots
from libs.recipe.template_format import Prompt
from services.gateway.config import ImageLimits
from services.gateway.served_model import VisionSpec

# Pillow's format names of the media types every API accepts (IMAGE_MEDIA_TYPES)
log = logging.getLogger(__name__)
DEATH_POLL_S = 0.5  # how often a request waiting on the encoders looks for a dead one
PROBED = ("JPEG", "PNG", "GIF", "WEBP")  # the Pillow plugins that may read a client's bytes
# (MPO: a JPEG with more pictures after the first, as cameras write them: the JPEG plugin opens it)
FORMATS = {
    "JPEG": "image/jpeg",
    "MPO": "image/jpeg",
    "PNG": "image/png",
    "GIF": "image/gif",
    "WEBP": "image/webp",
}


def check_image(data: bytes, param: str, limits: ImageLimits) -> str:
    """The image's media type, after decoding all of it; a 400 naming ``param`` otherwise. Only
    the accepted formats are probed (Pillow's other plugins never see the bytes)."""
    if len(data) > limits.max_image_bytes:
        raise ApiError(400, f"the image is {len(data)} bytes; at most {limits.max_image_bytes}", param=param)
    try:
        with Image.open(io.BytesIO(data), formats=PROBED) as image:
            if image.width * image.height > limits.max_image_pixels:
                why = f"the image is {image.width}x{image.height} pixels; at most {limits.max_image_pixels}"
                raise ApiError(400, why, param=param)
            image.load()  # decodes every pixel: a truncated file fails here
            return FORMATS[str(image.format)]
    except ApiError:
        raise
    except UnidentifiedImageError:
        raise ApiError(400, "the file is not a JPEG, PNG, GIF or WebP image", param=param) from None
    except Exception as exc:  # Pillow raises many kinds (OSError, SyntaxError, DecompressionBombError, ...)
        raise ApiError(400, f"the image cannot be decoded: {exc}", param=param) from None


def allowed_url(url: str, hosts: frozenset[str]) -> bool:
    """Whether ``url`` is http(s) to a listed host: "host" allows any port, "host:port" that one."""
    try:
        parsed = httpx.URL(url)
    except Exception:  # httpx.InvalidURL, and what its parser raises on odd input
        return False
    if parsed.scheme not in ("http", "https") or not parsed.host or parsed.userinfo:
        return False
    return parsed.host in hosts or f"{parsed.host}:{parsed.port}" in hosts


class ImageAdmission:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        store: MediaStore,
        vision: VisionSpec | None,
        limits: ImageLimits,
        live_encoders: Callable[[], set[str]] | None = None,
    ) -> None:
        """``live_encoders``: the ids of the encoders alive now (the gateway's members view);
        None: a dead encoder's requests wait out their timeout."""
        self.bus = bus
        self.subjects = subjects
        self.store = store
        self.vision = vision
        self.limits = limits
        self.live_encoders = live_encoders
        # Decoding checks a whole image (up to --max-image-pixels): two at a time, whatever the
        # load, so they leave the thread pool to tokenizing and the cores to the rest.
        self._decoding = asyncio.Semaphore(2)

    async def prepare(self, prompt: Prompt, encode_images: bool = True) -> Prompt:
        """``prompt`` with its image slots expanded and its images encoded (``encode_images``
        off: checked and counted only, as count_tokens wants)."""
        images = prompt.images
        if not images:
            return prompt
        vision = self.vision
        if vision is None:
            raise ApiError(400, UNSUPPORTED_INPUT.format(kind="image"), param=images[0].param)
        if len(images) > self.limits.max_images:
            why = f"{len(images)} images in one request; at most {self.limits.max_images}"
            raise ApiError(400, why, param=images[self.limits.max_images].param)
        files = await asyncio.gather(*(self._bytes(image) for image in images))
        async with self._decoding:
            hashes = await asyncio.to_thread(self._check, images, files)
        if encode_images:
            await self._encode(images, files, hashes, vision)
        return expand_image_slots(prompt, hashes, vision.image_token_id, vision.num_image_tokens)

    def _check(self, images: tuple[ImageInput, ...], files: list[bytes]) -> list[bytes]:
        """Decode each file whole (a 400 for the first bad one); their hashes. CPU work."""
        for image, data in zip(images, files, strict=True):
            check_image(data, image.param, self.limits)
        return [image_hash(data) for data in files]

    def _put(self, files: list[bytes], hashes: list[bytes]) -> None:
        for data, mm_hash in zip(files, hashes, strict=True):
            self.store.put_image(mm_hash, data)

    async def _bytes(self, image: ImageInput) -> bytes:
        if not image.url:
            return image.data
        if not allowed_url(image.url, self.limits.url_hosts):
            why = "image URLs are not fetched from this host (data URLs / base64 are always accepted)"
            raise ApiError(400, why, param=image.param)
        try:
            return await self._fetch(image.url)
        except ApiError as exc:
            raise ApiError(400, exc.message, param=image.param) from None
        except Exception as exc:  # httpx's errors, and what its URL and socket layers raise
            raise ApiError(400, f"the image URL could not be fetched: {exc!r}", param=image.param) from None

    async def _fetch(self, url: str) -> bytes:
        """The body, no redirects (one could lead off the allowed hosts), at most max_image_bytes."""
        limit = self.limits.max_image_bytes
        async with (
            httpx.AsyncClient(timeout=self.limits.url_timeout_s, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise ApiError(400, f"the image URL answered HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    raise ApiError(400, f"the image at the URL is over {limit} bytes")
            return bytes(body)

    async def _encode(
        self, images: tuple[ImageInput, ...], files: list[bytes], hashes: list[bytes], vision: VisionSpec
    ) -> None:
        """Store the files and have an encoder encode them (once more if one went missing: a
        failed request of the same image removed it meanwhile). Files of a failure are removed."""
        try:
            for _ in range(2):
                await asyncio.to_thread(self._put, files, hashes)
                reply = await self._ask(hashes, vision)
                if reply.missing_image < 0:
                    break
            self._check_reply(images, reply, vision)
        except BaseException:
            await asyncio.to_thread(self._remove, hashes)
            raise

    def _remove(self, hashes: list[bytes]) -> None:
        for mm_hash in hashes:
            self.store.remove_image(mm_hash)

    async def _ask(self, hashes: list[bytes], vision: VisionSpec) -> EncodeReply:
        """The encoders' reply, within ``encode_timeout_s``. The request goes out again (once)
        when an encoder that was live dies meanwhile: it may have held this one, which would
        otherwise wait out the timeout (an encoder is found dead by its heartbeat, in seconds)."""
        deadline = time.monotonic() + self.limits.encode_timeout_s
        try:
            data = await self._unless_an_encoder_dies(self._send(hashes, vision, deadline))
            if data is None:
                data = await self._send_when_one_listens(hashes, vision, deadline)
            return decode(EncodeReply, data)
        except (NoResponders, RequestTimeout) as exc:
            why = "no image encoder is serving this model" if isinstance(exc, NoResponders) else "timed out"
            raise ApiError(503, f"images: {why}", code="no_encoders", type_="server_error") from None
        except DecodeError as exc:
            raise ApiError(
                502, f"the image encoder's reply is unreadable: {exc}", type_="server_error"
            ) from None

    async def _send(self, hashes: list[bytes], vision: VisionSpec, deadline: float) -> bytes:
        timeout_s = max(deadline - time.monotonic(), 0.001)
        request = encode(EncodeRequest(vision.fingerprint, tuple(hashes), timeout_s))
        return await self.bus.request(self.subjects.encode(vision.fingerprint), request, timeout_s)

    async def _send_when_one_listens(self, hashes: list[bytes], vision: VisionSpec, deadline: float) -> bytes:
        """Send again, as soon as an encoder listens (the dead one's replacement may still be
        starting: the members view can show it, or show the dead one a while, before it listens)."""
        while True:
            try:
                return await self._send(hashes, vision, deadline)
            except NoResponders:
                if time.monotonic() + DEATH_POLL_S >= deadline:
                    raise
                await asyncio.sleep(DEATH_POLL_S)

    async def _unless_an_encoder_dies(self, send: Coroutine[Any, Any, bytes]) -> bytes | None:
        """``send``'s reply, or None (the request abandoned) once an encoder live at the start dies."""
        task = asyncio.ensure_future(send)
        if self.live_encoders is None:
            return await task
        live = self.live_encoders()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DEATH_POLL_S)
                if done:
                    return task.result()
                if not live <= self.live_encoders():
                    log.warning("an image encoder died while a request waited: asking again")
                    return None
        finally:
            task.cancel()

    @staticmethod
    def _check_reply(images: tuple[ImageInput, ...], reply: EncodeReply, vision: VisionSpec) -> None:
        if 0 <= reply.bad_image < len(images):
            why = f"the image cannot be processed: {reply.error}"
            raise ApiError(400, why, param=images[reply.bad_image].param)
        if reply.busy:
            raise ApiError(
                503, f"the image encoders are busy: {reply.error}", code="encoders_busy", type_="server_error"
            )
        if reply.error:
            raise ApiError(502, f"the image encoder failed: {reply.error}", type_="server_error")
        if reply.num_tokens != (vision.num_image_tokens,) * len(images):
            why = f"encoder outputs of {reply.num_tokens} rows; the model takes {vision.num_image_tokens}"
            raise ApiError(502, why, type_="server_error")
