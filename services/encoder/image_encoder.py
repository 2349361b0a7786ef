"""Image file bytes -> the vision tower's output rows, prepared as the checkpoint's processor
prepares them: decode (Pillow), resize, crop, normalize, then the ViT and projector in batches."""

from __future__ import annotations

import io
import logging

import numpy as np
import torch
from PIL import Image

from libs.modelfiles.llava_config import ImageProcessing
from libs.models.image_processor import preprocess
from libs.models.llava import VisionTower

log = logging.getLogger(__name__)
FORMATS = ("JPEG", "PNG", "GIF", "WEBP")  # Pillow's names of the media types every API accepts


class BadImage(ValueError):
    """Bytes that are not an image this service can decode: the client's mistake."""


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """The decoded image (fully: a truncated file fails here, not later), in RGB. Only the formats
    every API accepts are probed: Pillow's other plugins (EPS runs Ghostscript) never see a byte."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        if image.width * image.height > max_pixels:
            raise BadImage(f"{image.width}x{image.height} pixels: more than {max_pixels}")
        image.load()
        return image.convert("RGB")
    except BadImage:
        raise
    except Exception as exc:  # Pillow raises many kinds (OSError, SyntaxError, DecompressionBombError, ...)
        raise BadImage(f"not a readable image ({exc})") from None


class ImageEncoder:
    def __init__(
        self,
        tower: VisionTower,
        processing: ImageProcessing,
        device: torch.device,
        dtype: torch.dtype,
        max_batch_images: int,
        max_pixels: int = 1 << 26,
    ) -> None:
        self.tower = tower
        self.processing = processing
        self.device = device
        self.dtype = dtype
        self.max_batch_images = max_batch_images
        self.max_pixels = max_pixels

    def pixel_values(self, data: bytes) -> np.ndarray:
        """One image file -> [3, H, W] float32 as the model's processor makes it (BadImage)."""
        return preprocess(open_image(data, self.max_pixels), self.processing)

    @torch.inference_mode()
    def encode(self, pixels: list[np.ndarray]) -> list[torch.Tensor]:
        """Per image, its output rows [num_image_tokens, text hidden] on the CPU, in the model dtype."""
        out: list[torch.Tensor] = []
        for start in range(0, len(pixels), self.max_batch_images):
            batch = torch.from_numpy(np.stack(pixels[start : start + self.max_batch_images]))
            embeds = self.tower.encode(batch.to(self.device, self.dtype))  # [B, N, hidden]
            out += [e.to("cpu").contiguous() for e in embeds]
        return out
