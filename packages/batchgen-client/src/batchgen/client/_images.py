"""Image batches from a folder (shared by both clients and the CLI, no I/O but listing and hashing files): the
pictures in it, each distinct one to upload once, and the batch's lines naming them by file id."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif")


def folder_images(folder: str | os.PathLike[str]) -> list[Path]:
    """The images in ``folder`` (not its subfolders), by name."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder")
    images = sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in {root}")
    return images


def hashed(images: list[Path]) -> dict[Path, str]:
    """Each image's content hash (sha256)."""
    return {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in images}


def distinct(images: list[Path]) -> dict[str, Path]:
    """One path per distinct content: what is uploaded, once each."""
    seen: dict[str, Path] = {}
    for path, digest in hashed(images).items():
        seen.setdefault(digest, path)
    return seen


def image_lines(
    images: list[Path], file_ids: dict[Path, str], prompt: str, model: str, body: dict[str, Any]
) -> list[dict[str, Any]]:
    """One chat line per image: the picture by its upload's file id, then ``prompt``; ``custom_id`` its file
    name."""
    lines = []
    for path in images:
        content = [{"type": "file", "file": {"file_id": file_ids[path]}}, {"type": "text", "text": prompt}]
        lines.append({
            "custom_id": path.name,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], **body},
        })  # fmt: skip
    return lines
