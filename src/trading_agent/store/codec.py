"""Messages to JSON and back; pictures go to a table of their own, by content hash.

A message's content is stored as a JSON list of blocks in the conversation's own shape. An
image block holds only the SHA-256 of its bytes: the bytes are stored once in ``images``
(the same chart sent twice costs nothing more), and a transcript page stays small. A
thinking block is stored whole (its signature and the provider that made it), so that a
restarted desk sends it back; operators are not shown it (:func:`public_blocks`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from trading_agent.agent.conversation import (
    ContentBlock,
    ImageBlock,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.errors import StoreError
from trading_agent.jsontext import json_text

__all__ = [
    "ImageData",
    "decode_content",
    "encode_content",
    "image_refs",
    "public_blocks",
    "public_content",
]

ImageData = tuple[str, bytes]
"""An image's media type and bytes."""


def _image_json(block: ImageBlock, images: dict[str, ImageData]) -> dict[str, Any]:
    digest = hashlib.sha256(block.data).hexdigest()
    images[digest] = (block.media_type, block.data)
    return {"type": "image", "sha256": digest, "media_type": block.media_type,
            "description": block.description, "size": len(block.data)}


def _block_json(block: ContentBlock, images: dict[str, ImageData]) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    if isinstance(block, ImageBlock):
        return _image_json(block, images)
    if isinstance(block, ToolUseBlock):
        return {"type": "tool_use", "id": block.id, "name": block.name,
                "arguments": block.arguments}
    if isinstance(block, ThinkingBlock):
        return {"type": "thinking", "text": block.text, "signature": block.signature,
                "source": block.source, "redacted": block.redacted}
    return {"type": "tool_result", "tool_use_id": block.tool_use_id, "is_error": block.is_error,
            "content": [_block_json(inner, images) for inner in block.content]}


def encode_content(content: Sequence[ContentBlock]) -> tuple[str, dict[str, ImageData]]:
    """A message's blocks as JSON text, and the images it refers to.

    Args:
        content: The blocks.

    Returns:
        The JSON text, and the images by SHA-256 (to store in the images table).
    """
    images: dict[str, ImageData] = {}
    blocks = [_block_json(block, images) for block in content]
    # Text may hold a lone surrogate (half an emoji from a broken stream): still storable.
    return json_text(blocks), images


def image_refs(blocks: Sequence[Mapping[str, Any]]) -> set[str]:
    """The SHA-256 of every image the decoded JSON blocks refer to."""
    found: set[str] = set()
    for block in blocks:
        if block.get("type") == "image":
            found.add(str(block["sha256"]))
        elif block.get("type") == "tool_result":
            found |= image_refs(block.get("content", []))
    return found


def _decode_image(block: Mapping[str, Any], images: Mapping[str, ImageData]) -> ImageBlock:
    digest = str(block["sha256"])
    if digest not in images:
        raise StoreError(f"the image {digest} a message refers to is missing from the store")
    media_type, data = images[digest]
    return ImageBlock(data=data, media_type=media_type,
                      description=str(block.get("description", "image")))


def _decode_inner(block: Mapping[str, Any],
                  images: Mapping[str, ImageData]) -> TextBlock | ImageBlock:
    if block["type"] == "image":
        return _decode_image(block, images)
    return TextBlock(str(block["text"]))


def _decode_block(block: Mapping[str, Any], images: Mapping[str, ImageData]) -> ContentBlock:
    kind = block.get("type")
    if kind == "text":
        return TextBlock(str(block["text"]))
    if kind == "image":
        return _decode_image(block, images)
    if kind == "tool_use":
        return ToolUseBlock(id=str(block["id"]), name=str(block["name"]),
                            arguments=str(block["arguments"]))
    if kind == "thinking":
        return ThinkingBlock(text=str(block.get("text", "")),
                             signature=str(block.get("signature", "")),
                             source=str(block.get("source", "")),
                             redacted=str(block.get("redacted", "")))
    if kind == "tool_result":
        return ToolResultBlock(
            tool_use_id=str(block["tool_use_id"]), is_error=bool(block.get("is_error")),
            content=tuple(_decode_inner(inner, images) for inner in block.get("content", [])))
    raise StoreError(f"unknown content block type {kind!r} in the store")


def decode_content(blocks: Sequence[Mapping[str, Any]],
                   images: Mapping[str, ImageData]) -> tuple[ContentBlock, ...]:
    """Decoded JSON blocks back to content blocks.

    Args:
        blocks: The parsed JSON list.
        images: The images they refer to, by SHA-256.

    Returns:
        The blocks.

    Raises:
        StoreError: A block of an unknown type, or a missing image.
    """
    return tuple(_decode_block(block, images) for block in blocks)


def public_blocks(blocks: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Stored JSON blocks as operators see them: a thinking block is kept for the provider
    that made it, not shown."""
    return [block for block in blocks if block.get("type") != "thinking"]


def public_content(message: Message) -> list[dict[str, Any]]:
    """A message's blocks as JSON-ready data, images by reference (for operators)."""
    images: dict[str, ImageData] = {}
    return [_block_json(block, images) for block in message.content
            if not isinstance(block, ThinkingBlock)]
