"""A prompt's images at the gateway: each file decoded whole and limited (a 400 naming its part),
only allowed URL hosts fetched, a model without vision refusing them, the encoder's answers mapped
to statuses (its client's bad image a 400, no encoder a 503), and each slot expanded into the
model's image tokens with the span that names the image."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from libs.bus.base import Message
from libs.bus.memory import InMemoryBus
from libs.kvstore.media_store import MediaStore, image_hash
from libs.protocol.codec import decode, encode
from libs.protocol.media_messages import EncodeReply, EncodeRequest
from libs.protocol.messages import ImageSpan
from libs.protocol.subjects import Subjects
from libs.recipe.conversation import IMAGE_SLOT, ImageInput
from libs.recipe.fields import ApiError
from libs.recipe.template_format import Prompt
from services.gateway.config import ImageLimits
from services.gateway.image_admission import ImageAdmission, allowed_url, check_image
from services.gateway.served_model import VisionSpec

VISION = VisionSpec(image_token_id=900, num_image_tokens=3, fingerprint="fp")
LIMITS = ImageLimits(max_images=2, max_image_bytes=200_000, max_image_pixels=100 * 100)


def image_file(size: tuple[int, int] = (20, 10), fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(0).rand(size[1], size[0], 3) * 255).astype("uint8")).save(buf, fmt)
    return buf.getvalue()


def prompt_with(*images: ImageInput) -> Prompt:
    ids = [1, 2]
    for _ in images:
        ids += [IMAGE_SLOT, 3]
    return Prompt(ids, "plain", "content", False, False, images=images)


def part(data: bytes = b"", url: str = "", i: int = 0) -> ImageInput:
    return ImageInput(f"messages[0].content[{i}]", data=data, media_type="image/png", url=url)


def admission(
    tmp_path: Path, bus: InMemoryBus | None = None, vision: VisionSpec | None = VISION
) -> ImageAdmission:
    return ImageAdmission(bus or InMemoryBus(), Subjects(), MediaStore(tmp_path), vision, LIMITS)


async def encoder(bus: InMemoryBus, reply: EncodeReply | None = None) -> list[EncodeRequest]:
    """An encoder on the bus answering ``reply`` (default: every image 3 rows); the requests seen."""
    seen: list[EncodeRequest] = []

    async def on_encode(msg: Message) -> None:
        req = decode(EncodeRequest, msg.data)
        seen.append(req)
        await bus.respond(msg, encode(reply or EncodeReply((3,) * len(req.mm_hashes))))

    await bus.subscribe(Subjects().encode("fp"), on_encode)
    return seen


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (image_file()[:200], "cannot be decoded"),
        (b"\x89PNG\r\n\x1a\n not really", "not a JPEG, PNG, GIF or WebP"),
        (image_file((200, 100)), "pixels"),
        (image_file(fmt="BMP"), "not a JPEG, PNG, GIF or WebP"),
        (b"x" * 300_000, "bytes"),
    ],
    ids=["truncated", "garbage", "huge", "bmp", "too-many-bytes"],
)
def test_a_bad_file_is_a_400_naming_its_part(data: bytes, why: str) -> None:
    with pytest.raises(ApiError) as err:
        check_image(data, "messages[0].content[1]", LIMITS)
    assert err.value.status == 400 and why in err.value.message
    assert err.value.param == "messages[0].content[1]"


def test_a_camera_jpeg_with_more_pictures_is_a_jpeg() -> None:
    first, second = (Image.new("RGB", (8, 8), color) for color in ("red", "blue"))
    buf = io.BytesIO()
    first.save(buf, "MPO", save_all=True, append_images=[second])
    assert check_image(buf.getvalue(), "messages[0].content[0]", LIMITS) == "image/jpeg"


def test_slots_become_the_image_tokens_and_spans(tmp_path: Path) -> None:
    async def run() -> None:
        bus = InMemoryBus()
        seen = await encoder(bus)
        first, second = image_file((20, 10)), image_file((10, 20))
        out = await admission(tmp_path, bus).prepare(prompt_with(part(first), part(second, i=1)))
        assert out.token_ids == [1, 2, 900, 900, 900, 3, 900, 900, 900, 3]
        assert out.image_spans == (ImageSpan(image_hash(first), 2, 3), ImageSpan(image_hash(second), 6, 3))
        assert out.images == ()
        assert [(r.model_fingerprint, r.mm_hashes) for r in seen] == [
            ("fp", (image_hash(first), image_hash(second)))
        ]
        assert 0 < seen[0].timeout_s <= LIMITS.encode_timeout_s  # what is left of the gateway's wait
        assert MediaStore(tmp_path).read_image(image_hash(first)) == first  # for the encoder to read

    asyncio.run(run())


def test_counting_checks_but_neither_stores_nor_encodes(tmp_path: Path) -> None:
    async def run() -> None:
        data = image_file()
        out = await admission(tmp_path).prepare(prompt_with(part(data)), encode_images=False)
        assert len(out.token_ids) == 2 + 3 + 1
        assert not MediaStore(tmp_path).image_path(image_hash(data)).exists()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("reply", "status", "param"),
    [
        (EncodeReply(bad_image=1, error="cannot decode"), 400, "messages[0].content[1]"),
        (EncodeReply(error="out of memory"), 502, None),
        (EncodeReply((3, 4)), 502, None),  # not the model's number of rows
        (None, 503, None),  # no encoder at all
        (EncodeReply(busy=True, error="queue full"), 503, None),
    ],
    ids=["bad-image", "encoder-failed", "wrong-rows", "no-encoder", "busy"],
)
def test_the_encoders_answer_becomes_a_status(
    tmp_path: Path, reply: EncodeReply | None, status: int, param: str | None
) -> None:
    async def run() -> None:
        bus = InMemoryBus()
        if reply is not None:
            await encoder(bus, reply)
        with pytest.raises(ApiError) as err:
            await admission(tmp_path, bus).prepare(
                prompt_with(part(image_file()), part(image_file((9, 9)), i=1))
            )
        assert (err.value.status, err.value.param) == (status, param)

    asyncio.run(run())


@pytest.mark.parametrize(
    ("images", "vision", "why"),
    [
        ((part(image_file()),), None, "image input is not supported by this model"),
        (tuple(part(image_file(), i=i) for i in range(3)), VISION, "at most 2"),
        ((part(url="http://169.254.169.254/latest/meta-data"),), VISION, "not fetched from this host"),
    ],
    ids=["no-vision", "too-many", "disallowed-url"],
)
def test_refused_before_anything_is_stored(
    tmp_path: Path, images: tuple[ImageInput, ...], vision: VisionSpec | None, why: str
) -> None:
    with pytest.raises(ApiError) as err:
        asyncio.run(admission(tmp_path, vision=vision).prepare(prompt_with(*images)))
    assert err.value.status == 400 and why in err.value.message and err.value.param
    assert not any(tmp_path.iterdir())


def test_an_image_removed_meanwhile_is_stored_and_asked_for_once_more(tmp_path: Path) -> None:
    async def run() -> None:
        bus = InMemoryBus()
        replies = [EncodeReply(missing_image=0, error="gone"), EncodeReply((3,))]
        seen: list[EncodeRequest] = []

        async def on_encode(msg: Message) -> None:
            seen.append(decode(EncodeRequest, msg.data))
            MediaStore(tmp_path).remove_image(seen[-1].mm_hashes[0])  # as the encoder would
            await bus.respond(msg, encode(replies[len(seen) - 1]))

        await bus.subscribe(Subjects().encode("fp"), on_encode)
        out = await admission(tmp_path, bus).prepare(prompt_with(part(image_file())))
        assert len(seen) == 2 and len(out.image_spans) == 1

    asyncio.run(run())


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://img.example/cat.png", True),
        ("https://img.example:8443/cat.png", True),
        ("http://cdn.example:9000/cat.png", True),
        ("http://cdn.example:9001/cat.png", False),  # only the listed port
        ("ftp://img.example/cat.png", False),
        ("http://user@img.example/cat.png", False),
        ("http://img.example:abc/", False),  # no URL at all
        ("http://evil.example/cat.png", False),
    ],
)
def test_only_listed_hosts_are_fetched(url: str, allowed: bool) -> None:
    assert allowed_url(url, frozenset({"img.example", "cdn.example:9000"})) is allowed


def test_a_request_held_by_an_encoder_that_dies_is_sent_again(tmp_path: Path) -> None:
    async def run() -> None:
        bus = InMemoryBus()
        live = {"encoder-1"}

        async def took_it_and_died(msg: Message) -> None:
            pass  # never answers

        dead = await bus.subscribe(Subjects().encode("fp"), took_it_and_died)
        images = ImageAdmission(bus, Subjects(), MediaStore(tmp_path), VISION, LIMITS, lambda: set(live))
        pending = asyncio.ensure_future(images.prepare(prompt_with(part(image_file()))))
        await asyncio.sleep(0.2)
        assert not pending.done()
        await dead.unsubscribe()
        live.clear()  # its heartbeat stopped: the members view no longer holds it
        await asyncio.sleep(1.0)  # asked again at once: nobody listens yet
        await encoder(bus)  # its replacement, up
        out = await asyncio.wait_for(pending, 5)  # well within the 60 s the dead one would cost
        assert len(out.image_spans) == 1

    asyncio.run(run())
