"""Which requests may reach the server (ORIGIN_POLICY): Host must name it and a browser's Origin must be its own, so
that a web page cannot drive a keyless local server, neither cross-site nor by DNS rebinding."""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from .schema import APIError, ServeConfig

LOOPBACK = ("localhost", "127.0.0.1", "::1")
ORIGIN_POLICY = (
    "Requests must name this server in Host: localhost, 127.0.0.1, [::1], an IP address or the --host value "
    "(any port); a browser's Origin must be this server's own (http://localhost:PORT ...). So a web page cannot "
    "drive a keyless local server, neither cross-site nor by DNS rebinding: 403 otherwise. --allow-origin NAME "
    "(repeatable) adds a server name (a host, as in Host) or a web origin (scheme://host[:port], also answered "
    "with CORS headers); '*' allows any. POST bodies must be Content-Type: application/json (415 otherwise).")


def _hostname(netloc: str) -> str:
    """'Example.com:8080' -> 'example.com', '[::1]:80' -> '::1'; '' when it is not a plain host[:port]."""
    if "@" in netloc or "/" in netloc:
        return ""
    if netloc.count(":") > 1 and not netloc.startswith("["):  # a bare IPv6 address (--host ::)
        return netloc.lower()
    try:
        return urlsplit("//" + netloc).hostname or ""
    except ValueError:
        return ""


def _origin(value: str) -> tuple | None:
    """'HTTP://Host:80' -> ('http', 'host', 80): an origin compared as browsers do; None if it is not one."""
    try:
        u = urlsplit(value)
        return (u.scheme, u.hostname, u.port or {"http": 80, "https": 443}.get(u.scheme)) if u.hostname else None
    except ValueError:
        return None


def check_origin(headers, cfg: ServeConfig) -> None:
    """ORIGIN_POLICY: 403 unless Host names this server and Origin (sent by browsers) is its own or allowed."""
    allow = cfg.allow_origins
    if "*" in allow:
        return
    names = ({*LOOPBACK, _hostname(cfg.host)} | {_hostname(v) for v in allow if "://" not in v}) - {""}
    host = headers.get("host")
    if host is not None:
        name = _hostname(host)
        try:
            ipaddress.ip_address(name)  # an address, not a name: DNS rebinding needs a name
        except ValueError:
            if name not in names:
                raise APIError(403, f"the Host header names {host!r}, not this server: use localhost, 127.0.0.1 "
                                    f"or its --host; to serve under that name restart with --allow-origin "
                                    f"{name or host} (a guard against DNS rebinding)", code="forbidden_host")
    origin = headers.get("origin")
    if origin is not None:
        o = _origin(origin)
        own = o is not None and o[0] in ("http", "https") and o[1] in names and cfg.port in (None, o[2])
        if not own and (o is None or o not in {_origin(v) for v in allow if "://" in v}):
            raise APIError(403, f"requests from web pages at {origin} are refused (a guard against cross-site use "
                                f"of this server): restart with --allow-origin {origin} to allow that site",
                           code="forbidden_origin")
