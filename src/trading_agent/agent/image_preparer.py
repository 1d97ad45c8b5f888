"""Pictures for the model: sized once, and only the newest few sent.

:meth:`ImagePreparer.prepare` scales a picture (a tool's chart, an operator's screenshot) to
the model's limits (longest side, byte size; from the desk's config) and encodes it once; the
:class:`ImageBlock` it returns is what the conversation and the store keep.

Every image sent stays in every later request unless it is taken out, so before each model
call :meth:`ImagePreparer.prune` keeps only the ``keep`` (four) newest images in what is sent;
each older one becomes a short text placeholder naming what it was. Only what is sent
changes: the conversation, and so the store, keep the originals. The result is deterministic
(the same conversation gives byte-identical requests, so providers' prompt caches keep
working) and memoized per message.

Every path a picture takes to the model goes through :meth:`ImagePreparer.prepare` with the
desk's limits: a tool's picture in the
:class:`~trading_agent.agent.tool_call_executor.ToolCallExecutor`, an operator's in the desk
before it is stored. An operator's picture must be a PNG, JPEG, GIF
or WebP (:data:`OPERATOR_MEDIA_TYPES`, the formats vision models take); one that is not a
picture, not one of those, or too large to open (:data:`MAX_PIXELS`) is refused with an
:class:`ImageRejectedError` naming the limit.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import anyio.to_thread
from PIL import Image, UnidentifiedImageError

from trading_agent.agent.conversation import (
    ContentBlock,
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
)
from trading_agent.errors import TradingAgentError

__all__ = [
    "MAX_PIXELS",
    "OPERATOR_FORMATS",
    "OPERATOR_MEDIA_TYPES",
    "ImageLimits",
    "ImagePreparer",
    "ImageRejectedError",
]

OPERATOR_MEDIA_TYPES: dict[str, str] = {
    "image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}
"""The pictures an operator may send, by media type, with pillow's name of the format."""

OPERATOR_FORMATS = frozenset(OPERATOR_MEDIA_TYPES.values())
"""Pillow's names of the formats an operator may send."""

MAX_PIXELS = 50_000_000
"""The most pixels a picture may have to be opened at all (8,000 × 6,250): past it, decoding
alone would take hundreds of megabytes. Below pillow's own decompression-bomb mark."""

RejectionCode = Literal["not_an_image", "unsupported_image", "image_too_large"]


class ImageRejectedError(TradingAgentError, ValueError):
    """A picture that cannot be sent to the model; nothing was stored.

    Args:
        code: ``not_an_image``, ``unsupported_image`` or ``image_too_large``.
        message: What is wrong, naming the limit or the formats allowed.
    """

    def __init__(self, code: RejectionCode, message: str) -> None:
        super().__init__(message)
        self.code: RejectionCode = code

    @property
    def too_large(self) -> bool:
        """Whether it was refused for its size (HTTP 413), not its content (400)."""
        return self.code == "image_too_large"


@dataclass(frozen=True)
class ImageLimits:
    """What the model accepts.

    Attributes:
        max_side: The longest side in pixels.
        max_bytes: The largest encoded size.
        keep: How many of the newest images are sent; older ones become placeholders.
    """

    max_side: int = 1568
    max_bytes: int = 3_750_000
    keep: int = 4


class ImagePreparer:
    """Sizes images for the model and prunes old ones from what is sent.

    Args:
        limits: The model's limits; the defaults suit most vision models.
    """

    def __init__(self, limits: ImageLimits | None = None) -> None:
        self.limits = limits or ImageLimits()

    def prepare(self, data: bytes, description: str = "image", *,
                formats: Collection[str] | None = None) -> ImageBlock:
        """Resizes and re-encodes a picture to fit the limits; blocking (see prepare_async).

        A PNG or JPEG that already fits is kept byte for byte; anything else is scaled to the
        longest side and encoded once: PNG when it fits the byte limit, else JPEG at falling
        quality, then at falling size.

        Args:
            data: The picture's bytes, in any format pillow reads.
            description: What it shows, for the placeholder that stands for it once pruned.
            formats: The formats accepted (pillow's names, such as :data:`OPERATOR_FORMATS`);
                None for any pillow reads (a tool's own chart).

        Returns:
            The encoded image block.

        Raises:
            ImageRejectedError: The bytes are not a picture, not in ``formats``, larger than
                :data:`MAX_PIXELS`, or cannot be made small enough (also a ValueError).
        """
        image, source_format = _open(data, formats)
        limits = self.limits
        fits_side = max(image.size) <= limits.max_side
        if fits_side and len(data) <= limits.max_bytes and (
                source_format == "PNG" or (source_format == "JPEG" and image.mode in ("RGB", "L"))):
            media_type = "image/png" if source_format == "PNG" else "image/jpeg"
            return ImageBlock(data=data, media_type=media_type, description=description)
        if not fits_side:
            image.thumbnail((limits.max_side, limits.max_side), Image.Resampling.LANCZOS)
        if image.mode not in ("RGB", "RGBA", "L", "LA", "P"):
            image = image.convert("RGBA")
        encoded = _encode(image, "PNG")
        if len(encoded) <= limits.max_bytes:
            return ImageBlock(data=encoded, media_type="image/png", description=description)
        rgb = _flatten(image)
        for quality in (85, 70, 55, 40):
            encoded = _encode(rgb, "JPEG", quality=quality)
            if len(encoded) <= limits.max_bytes:
                return ImageBlock(data=encoded, media_type="image/jpeg", description=description)
        while len(encoded) > limits.max_bytes and min(rgb.size) > 16:
            rgb = rgb.resize((max(1, rgb.width * 2 // 3), max(1, rgb.height * 2 // 3)),
                             Image.Resampling.LANCZOS)
            encoded = _encode(rgb, "JPEG", quality=40)
        if len(encoded) > limits.max_bytes:
            raise ImageRejectedError(
                "image_too_large",
                f"the picture cannot be made smaller than {limits.max_bytes} bytes (the desk's "
                "images.max_bytes)")
        return ImageBlock(data=encoded, media_type="image/jpeg", description=description)

    async def prepare_async(self, data: bytes, description: str = "image", *,
                            formats: Collection[str] | None = None) -> ImageBlock:
        """:meth:`prepare` in a worker thread, so pillow never blocks the event loop."""
        return await anyio.to_thread.run_sync(
            functools.partial(self.prepare, data, description, formats=formats))

    def kept(self, limit: int | None = None) -> int:
        """How many of the newest images are sent: the limits' ``keep``, or ``limit`` when
        fewer (a conversation's ``picture_limit``)."""
        return self.limits.keep if limit is None else min(limit, self.limits.keep)

    def prune(self, messages: Sequence[Message], keep: int | None = None) -> list[Message]:
        """Keeps the newest ``keep`` images; older ones become text placeholders.

        Args:
            messages: What would be sent, oldest first.
            keep: How many to keep, if fewer than the limits' ``keep`` (a conversation's
                ``picture_limit``).

        Returns:
            The messages to send; messages without pruned images are the same objects.
        """
        keep = self.kept(keep)
        seen = 0
        pruned: list[Message] = []
        for message in reversed(messages):
            count = message.image_count
            if count == 0:
                pruned.append(message)
                continue
            keep_here = max(0, min(count, keep - seen))
            seen += count
            pruned.append(message if keep_here == count else _without_images(message, keep_here))
        pruned.reverse()
        return pruned


def _open(data: bytes, formats: Collection[str] | None) -> tuple[Image.Image, str]:
    """The decoded picture and its format, or why it cannot be used."""
    allowed = None if formats is None else sorted(formats)
    try:
        # Only the allowed decoders are tried: an operator's upload never reaches pillow's
        # rarer (and less exercised) plugins.
        with Image.open(io.BytesIO(data), formats=allowed) as opened:
            width, height = opened.size
            if width * height > MAX_PIXELS:
                raise ImageRejectedError(
                    "image_too_large",
                    f"the picture is {width} × {height} pixels; the most that can be opened is "
                    f"{MAX_PIXELS:,} pixels")
            opened.load()
            return opened.copy(), str(opened.format)
    except ImageRejectedError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # The warning is raised only where warnings are errors (the tests); elsewhere it is
        # logged, and the size check above refuses the picture.
        raise ImageRejectedError("image_too_large", f"the picture is too large to open: {exc}") \
            from exc
    except (OSError, ValueError) as exc:
        if allowed is not None:
            found = _format_of(data)
            if found is not None:
                names = ", ".join(_FORMAT_NAMES.get(f, f) for f in allowed)
                raise ImageRejectedError(
                    "unsupported_image",
                    f"the picture is a {found}; send {names}") from exc
        # Pillow names the buffer object in its message; the reader needs only the reason.
        reason = ("no known picture format" if isinstance(exc, UnidentifiedImageError)
                  else str(exc))
        raise ImageRejectedError("not_an_image", f"not a readable picture: {reason}") from exc


_FORMAT_NAMES = {"JPEG": "JPEG", "PNG": "PNG", "GIF": "GIF", "WEBP": "WebP"}


def _format_of(data: bytes) -> str | None:
    """The format pillow finds in a header, without decoding any pixels."""
    try:
        with Image.open(io.BytesIO(data)) as opened:
            return opened.format
    except (OSError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning):
        return None


def _flatten(image: Image.Image) -> Image.Image:
    """RGB for JPEG: transparent parts on white (a chart's background), not on black."""
    if image.mode in ("RGBA", "LA", "P"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def _encode(image: Image.Image, image_format: str, **options: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format, optimize=True, **options)
    return buffer.getvalue()


def _placeholder(image: ImageBlock) -> TextBlock:
    return TextBlock(f"[image removed to save space: {image.description}]")


def _without_images(message: Message, keep_last: int) -> Message:
    """The message with all but its last ``keep_last`` images replaced; memoized."""
    key = f"pruned:{keep_last}"
    cached = message.cache.get(key)
    if isinstance(cached, Message):
        return cached
    total = message.image_count
    drop = total - keep_last
    dropped = 0

    def replace(block: ImageBlock) -> TextBlock | ImageBlock:
        nonlocal dropped
        if dropped < drop:
            dropped += 1
            return _placeholder(block)
        return block

    content: list[ContentBlock] = []
    for block in message.content:
        if isinstance(block, ImageBlock):
            content.append(replace(block))
        elif isinstance(block, ToolResultBlock) and any(
                isinstance(b, ImageBlock) for b in block.content):
            inner = tuple(replace(b) if isinstance(b, ImageBlock) else b for b in block.content)
            content.append(ToolResultBlock(block.tool_use_id, inner, block.is_error))
        else:
            content.append(block)
    result = Message(role=message.role, content=tuple(content), kind=message.kind,
                     id=message.id, created_at=message.created_at)
    message.cache[key] = result
    return result
