"""The encoder's answers, with the tiny random LLaVA's real tower over a media store on disk: new
images encoded in one batch and stored, a cached one answered without the tower (and its file
touched), another encoder's output taken as it is, a file that is not an image the client's fault
by index, a file gone a retryable miss, a request older than its gateway's wait not run, and the
cache within its budget once outputs age past the minimum."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from libs.bus.memory import InMemoryBus
from libs.kvstore.media_store import MediaStore, image_hash
from libs.modelfiles.llava_config import read_llava_config
from libs.models.llava_loader import load_llava_vision
from libs.models.tiny_llava import write_tiny_llava
from libs.protocol.media_messages import EncodeRequest
from services.encoder.config import Config
from services.encoder.image_encoder import ImageEncoder
from services.encoder.service import EncoderService

FINGERPRINT = "tiny"


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> ImageEncoder:
    directory = write_tiny_llava(tmp_path_factory.mktemp("llava"))
    processing = read_llava_config(directory).image_processing
    return ImageEncoder(load_llava_vision(directory), processing, torch.device("cpu"), torch.float32, 4)


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(20, 30, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def service_on(tmp_path: Path, encoder: ImageEncoder, **config: Any) -> EncoderService:
    return EncoderService(Config(**config), InMemoryBus(), MediaStore(tmp_path), encoder, FINGERPRINT)


def put(service: EncoderService, *datas: bytes) -> tuple[bytes, ...]:
    for data in datas:
        service.store.put_image(image_hash(data), data)
    return tuple(image_hash(data) for data in datas)


def test_new_images_are_encoded_and_cached_ones_are_not(tmp_path: Path, encoder: ImageEncoder) -> None:
    service = service_on(tmp_path, encoder)
    hashes = put(service, png(1), png(2))
    reply = service.handle(EncodeRequest(FINGERPRINT, hashes))
    assert (reply.num_tokens, reply.num_cached, reply.error) == ((16, 16), 0, "")
    assert service.num_encoded == 2 and not service.store.image_path(hashes[0]).exists()  # read: removed
    stored = service.store.read_embeds(FINGERPRINT, hashes[0])
    os.utime(service.store.embeds_path(FINGERPRINT, hashes[0]), (1.0, 1.0))
    again = service.handle(EncodeRequest(FINGERPRINT, (*put(service, png(1)), hashes[1])))
    assert (again.num_tokens, again.num_cached, service.num_encoded) == ((16, 16), 2, 2)
    assert service.store.read_embeds(FINGERPRINT, hashes[0]) == stored  # not written again
    assert service.store.embeds_used_at(FINGERPRINT, hashes[0]) > time.time() - 60  # touched: used
    service.cache.check_integrity()
    # a restarted encoder (or another one) finds the outputs in the store
    other = service_on(tmp_path, encoder)
    other.load_cache()
    assert other.handle(EncodeRequest(FINGERPRINT, hashes)).num_cached == 2 and other.num_encoded == 0


def test_failures_name_the_image_and_say_whose_fault(tmp_path: Path, encoder: ImageEncoder) -> None:
    service = service_on(tmp_path, encoder)
    good, bad = put(service, png(3), b"not an image")
    reply = service.handle(EncodeRequest(FINGERPRINT, (good, bad)))
    assert reply.bad_image == 1 and "not a readable image" in reply.error
    gone = image_hash(b"never stored")
    assert service.handle(EncodeRequest(FINGERPRINT, (good, gone))).missing_image == 1
    late = service.handle(EncodeRequest(FINGERPRINT, (good,), timeout_s=1.0), received=time.monotonic() - 2)
    assert late.busy and not late.num_tokens
    assert service.handle(EncodeRequest("another-model", (good,))).error


def test_the_cache_keeps_its_budget_once_outputs_are_old_enough(
    tmp_path: Path, encoder: ImageEncoder
) -> None:
    probe = service_on(tmp_path / "probe", encoder)
    probe.handle(EncodeRequest(FINGERPRINT, put(probe, png(9))))
    one = probe.cache.num_bytes  # one output's size
    young = service_on(tmp_path / "young", encoder, encoder_cache_gb=1.5 * one / (1 << 30))
    first = put(young, png(4))
    young.handle(EncodeRequest(FINGERPRINT, first))
    young.handle(EncodeRequest(FINGERPRINT, put(young, png(5))))
    assert len(young.cache) == 2  # over budget, but both were used just now: none evicted
    old = service_on(
        tmp_path / "old", encoder, encoder_cache_gb=1.5 * one / (1 << 30), encoder_cache_min_age_s=0
    )
    first = put(old, png(4))
    old.handle(EncodeRequest(FINGERPRINT, first))
    old.handle(EncodeRequest(FINGERPRINT, put(old, png(5))))
    assert len(old.cache) == 1 and not old.store.has_embeds(FINGERPRINT, first[0])  # the older one went
    assert old.cache.num_evicted == 1
    old.cache.check_integrity()
