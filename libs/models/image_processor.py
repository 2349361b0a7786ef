"""One image -> the pixel values a CLIP vision tower reads, exactly as transformers' slow
(PIL/numpy) CLIPImageProcessor computes them.

The steps and their arithmetic follow it so the result matches to the bit: RGB conversion that
composites transparency onto white, PIL resize of the shortest edge (the long edge truncated, not
rounded), a center crop that zero-pads an image smaller than the crop, rescale in float64 then
cast to float32, and normalize in float32. No torch: this runs wherever a request's image is read.
"""

from __future__ import annotations

import math

import numpy as np
import PIL.Image

from libs.modelfiles.llava_config import ImageProcessing


def preprocess(image: PIL.Image.Image, processing: ImageProcessing) -> np.ndarray:
    """A PIL image of any size and mode -> float32 [3, H, W] (H, W: the crop size when cropping)."""
    if processing.do_convert_rgb:
        image = _to_rgb(image)
    elif image.mode != "RGB":
        raise ValueError(f"an image in mode {image.mode!r} needs do_convert_rgb (3 channels expected)")
    if processing.do_resize:
        height, width = resized_size(image.height, image.width, processing.shortest_edge)
        image = image.resize((width, height), resample=PIL.Image.Resampling(processing.resample))
    pixels = np.moveaxis(np.asarray(image), -1, 0)  # [3, H, W] uint8
    if processing.do_center_crop:
        pixels = center_crop(pixels, processing.crop_height, processing.crop_width)
    values: np.ndarray = pixels
    if processing.do_rescale:
        # transformers upcasts to float64 before scaling, then casts down: same rounding here.
        values = (pixels.astype(np.float64) * processing.rescale_factor).astype(np.float32)
    if processing.do_normalize:
        values = values.astype(np.float32, copy=False)
        mean = np.asarray(processing.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(processing.image_std, dtype=np.float32)[:, None, None]
        values = (values - mean) / std
    return np.ascontiguousarray(values, dtype=np.float32)


def resized_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """(height, width) with the shorter side at shortest_edge and the longer one scaled by the same
    factor, truncated: transformers' get_resize_output_image_size(default_to_square=False)."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest_edge * long / short)
    return (new_long, shortest_edge) if width <= height else (shortest_edge, new_long)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """pixels [C, H, W] -> [C, height, width] around the center; where the image is smaller than
    the crop it is centered on a zero canvas first (transformers' center_crop, padding included)."""
    _, orig_height, orig_width = pixels.shape
    top, left = (orig_height - height) // 2, (orig_width - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + height, left : left + width]
    canvas_height, canvas_width = max(height, orig_height), max(width, orig_width)
    canvas = np.zeros((pixels.shape[0], canvas_height, canvas_width), dtype=pixels.dtype)
    top_pad = math.ceil((canvas_height - orig_height) / 2)
    left_pad = math.ceil((canvas_width - orig_width) / 2)
    canvas[:, top_pad : top_pad + orig_height, left_pad : left_pad + orig_width] = pixels
    top, left = top + top_pad, left + left_pad
    return canvas[
        :, max(0, top) : min(canvas_height, top + height), max(0, left) : min(canvas_width, left + width)
    ]


def _to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """RGB; transparency (an alpha band, or a palette's transparent index) composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
