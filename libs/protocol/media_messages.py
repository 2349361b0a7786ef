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


@dataclass(frozen=True, slots=True)
class EncodeReply:
    """Per image, its number of embedding rows (now in the media store); or why it failed.

    ``bad_image`` >= 0: that image cannot be decoded or processed (the client's mistake, a 400);
    ``error``: what went wrong (with ``bad_image`` -1: the encoder's fault, a 5xx).
    """

    num_tokens: tuple[int, ...] = ()
    num_cached: int = 0  # of the images, those found in the encoder cache (not encoded again)
    encoder_id: str = ""
    error: str = ""
    bad_image: int = -1
