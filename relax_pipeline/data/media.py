"""Images at the two boundaries: dataset sources → data URIs for agents, request URLs → PIL images.

Towards the agent (docs/design.md §3.2): `image_url(source)` turns what a dataset row holds into the URL an
OpenAI `image_url` part carries. Local paths (relative ones resolved against the dataset file's folder
by the dataset), raw bytes, in-memory PIL images and `{"bytes": ...}` / `{"path": ...}` dicts (the
Hugging Face `datasets` image form; `bytes` may also be base64 text in JSONL) become RGB PNG data URIs;
`data:`, `http://` and `https://` URLs pass through untouched. `image_parts` splits a text on the
`<image>` placeholder and puts one image part where each placeholder was.

From requests: `load_image(url)` decodes a data URI, or fetches an http(s) URL with a short timeout,
into an RGB PIL image. Every failure is a `MediaError` saying what was wrong; callers attach the field.

Not done here: resizing or patching (the model's image processor does that), other media kinds.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

PLACEHOLDER = "<image>"
"""The dataset's image placeholder: one per image, in order."""
URL_PREFIXES: tuple[str, ...] = ("data:", "http://", "https://")
FETCH_TIMEOUT_S = 5.0
MAX_FETCH_BYTES = 32 * 2**20


class MediaError(ValueError):
    """An image that cannot be read or converted; the text says why."""


def image_url(source: Any, base_dir: Path | None = None) -> str:
    """The URL for an `image_url` part: a URL as given, anything else as an RGB PNG data URI."""
    if isinstance(source, str) and source.startswith(URL_PREFIXES):
        return source
    return png_data_uri(open_source(source, base_dir))


def open_source(source: Any, base_dir: Path | None = None) -> Image.Image:
    """A local image source (path, bytes, PIL image, `{"bytes"|"path"}` dict) as a PIL image."""
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, bytes | bytearray):
        return _decode(bytes(source), "image bytes")
    if isinstance(source, str | Path):
        return _decode(_read(resolve_path(source, base_dir)), str(source))
    if isinstance(source, Mapping):
        return _open_dict(source, base_dir)
    raise MediaError(f"an image must be a path, bytes, a PIL image, a {{'bytes'|'path'}} dict or a data:/http(s) "
                     f"URL, got {type(source).__name__}")


def resolve_path(path: str | Path, base_dir: Path | None) -> Path:
    """`path`, relative ones taken from `base_dir` (the dataset file's folder)."""
    resolved = Path(path).expanduser()
    return resolved if resolved.is_absolute() or base_dir is None else base_dir / resolved


def _open_dict(source: Mapping[str, Any], base_dir: Path | None) -> Image.Image:
    data = source.get("bytes")
    if isinstance(data, bytes | bytearray):
        return _decode(bytes(data), "image bytes")
    if isinstance(data, str) and data:
        return _decode(_b64(data, "the 'bytes' text"), "image bytes")
    if isinstance(source.get("path"), str) and source["path"]:
        return open_source(source["path"], base_dir)
    raise MediaError("an image dict needs non-empty 'bytes' (raw or base64) or 'path'")


def _read(path: Path) -> bytes:
    if not path.is_file():
        raise MediaError(f"image file {str(path)!r} does not exist")
    return path.read_bytes()


def _decode(data: bytes, what: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise MediaError(f"{what} is not a readable image ({error})") from None
    return image


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what} is not valid base64") from None


def png_data_uri(image: Image.Image) -> str:
    """`data:image/png;base64,...` of the image converted to RGB."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def load_image(url: str) -> Image.Image:
    """An RGB PIL image from a data URI (base64) or an http(s) URL (fetched with a short timeout)."""
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise MediaError("a data URI image must be base64: data:image/<type>;base64,<data>")
        return _decode(_b64(payload, "the data URI payload"), "the data URI").convert("RGB")
    if url.startswith(("http://", "https://")):
        return _decode(_fetch(url), f"the image at {url[:80]!r}").convert("RGB")
    raise MediaError(f"an image URL must start with data:, http:// or https://, got {url[:40]!r}")


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310 - http(s) checked
            data = response.read(MAX_FETCH_BYTES + 1)
    except (OSError, ValueError) as error:
        raise MediaError(f"could not fetch the image at {url[:80]!r} within {FETCH_TIMEOUT_S:g} s ({error}); "
                         "send it as a data URI") from None
    if len(data) > MAX_FETCH_BYTES:
        raise MediaError(f"the image at {url[:80]!r} is larger than {MAX_FETCH_BYTES >> 20} MiB")
    return data


def count_placeholders(value: Any) -> int:
    """`<image>` placeholders in a prompt: a string, or the string/text-part contents of a message list."""
    if isinstance(value, str):
        return value.count(PLACEHOLDER)
    if isinstance(value, list):
        return sum(_content_count(m.get("content")) for m in value if isinstance(m, Mapping))
    return 0


def _content_count(content: Any) -> int:
    if isinstance(content, str):
        return content.count(PLACEHOLDER)
    if isinstance(content, list):
        return sum(p["text"].count(PLACEHOLDER) for p in content
                   if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return 0


def image_parts(text: str, urls: Sequence[str]) -> list[dict[str, Any]]:
    """OpenAI content parts: the text split at each `<image>` with the next URL's image part there."""
    pieces = text.split(PLACEHOLDER)
    if len(pieces) - 1 != len(urls):
        raise MediaError(f"the text has {len(pieces) - 1} {PLACEHOLDER} placeholders for {len(urls)} images")
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if piece:
            parts.append({"type": "text", "text": piece})
        if i < len(urls):
            parts.append({"type": "image_url", "image_url": {"url": urls[i]}})
    return parts
