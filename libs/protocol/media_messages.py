"""Messages between the gateways and the encoders: which images to encode, and what came of it.

Image bytes and embeddings never ride on NATS (a message is at most a few MB, an image may be
more): both lie in the media store (``libs/kvstore/media_store.py``), and these messages name them
by content hash.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EncodeRequest:
    """Encode these images (stored under their hashes) with the vision tower of this model."""

    model_fingerprint: str  # the checkpoint's content fingerprint: the embeddings' cache key
    mm_hashes: tuple[bytes, ...]  # each image's sha256, as stored in the media store
    timeout_s: float = 0.0  # the gateway waits this long: a request queued longer is not run (0: no limit)


@dataclass(frozen=True, slots=True)
class EncodeReply:
    """Per image, its number of embedding rows (now in the media store); or why it failed.

    ``bad_image`` >= 0: that image cannot be decoded or processed (the client's mistake, a 400);
    ``missing_image`` >= 0: that image's file is not in the media store (removed by a failed request
    of the same image meanwhile: the gateway stores it again and asks once more); ``busy``: the
    encoder's queue is full (a 503); else ``error``: what went wrong (the encoder's fault, a 5xx).
    """

    num_tokens: tuple[int, ...] = ()
    num_cached: int = 0  # of the images, those found in the encoder cache (not encoded again)
    encoder_id: str = ""
    error: str = ""
    bad_image: int = -1
    missing_image: int = -1
    busy: bool = False
