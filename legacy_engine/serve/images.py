"""The images of an OpenAI chat request: `image_url` content parts -> preprocessed images, in prompt order.

Accepted: `data:` URLs (base64, any of the formats format/image.py decodes), and `file://` URLs only under the
directory the server was started with (`--allow-file-images DIR`; off by default: a client must not read the
server's disk). The server fetches nothing from the network: an http(s) URL is refused with what to send instead.
Every problem is an ImageRequestError naming the part (schema.plan_chat answers it with a 400), never a crash.
"""
from __future__ import annotations

import base64
import binascii
import os
from urllib.parse import unquote, urlparse

from ..core.errors import FormatError, UnavailableError


class ImageRequestError(ValueError):
    """A request's image the server will not take; code: the OpenAI error code."""

    def __init__(self, message: str, code: str = "invalid_image"):
        super().__init__(message)
        self.code = code


def _bad(message: str) -> ImageRequestError:
    return ImageRequestError(message)


def _url_of(part: dict, where: str) -> str:
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise _bad(f"{where}: an image_url part needs image_url.url (a data: URL)")
    return url


def _data_url(url: str, where: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise _bad(f"{where}: a data: URL must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"{where}: the data: URL's base64 is invalid") from None


def _file_url(url: str, where: str, image_dir: str | None) -> str:
    if image_dir is None:
        raise _bad(f"{where}: file:// image URLs are off on this server (start it with --allow-file-images DIR); "
                   "send the image as a data: URL")
    path = os.path.realpath(unquote(urlparse(url).path))
    root = os.path.realpath(image_dir)
    if os.path.commonpath([path, root]) != root:
        raise _bad(f"{where}: {url!r} is outside the directory this server reads images from")
    return path


def _source(url: str, where: str, image_dir: str | None):
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, where)
    if scheme == "file":
        return _file_url(url, where, image_dir)
    raise _bad(f"{where}: this server fetches no URLs ({scheme or 'no'} scheme); send the image as a data: URL")


def request_images(messages: list, engine, image_dir: str | None) -> list:
    """The images of `messages`' image_url parts, in order, preprocessed (format.image.ImageInput). image_dir: the
    directory file:// URLs may name (None: refused)."""
    found = [(f"messages[{i}].content[{j}]", p) for i, m in enumerate(messages) if isinstance(m, dict)
             and isinstance(m.get("content"), list) for j, p in enumerate(m["content"])
             if isinstance(p, dict) and p.get("type") in ("image_url", "image")]
    if not found:
        return []
    if engine.vision is None:
        raise ImageRequestError("this server has no vision projector (start it with --mmproj FILE): images are not "
                                "accepted", code="unsupported_value")
    images = []
    for where, part in found:
        src = _source(_url_of(part, where), where, image_dir)
        try:
            images += engine.load_images([src])
        except (FormatError, UnavailableError, OSError) as e:
            raise _bad(f"{where}: {e}") from None
    return images
