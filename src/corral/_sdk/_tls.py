"""The TLS context every client of the SDK shares."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def default_ssl_context() -> ssl.SSLContext:
    """httpx's default TLS settings (certifi's roots, or `SSL_CERT_FILE`/`SSL_CERT_DIR`), made once per process.

    Every `Sandbox` has a client of its own, and httpx builds a new context for each (loading the whole root
    store: ~20 ms, the largest part of a create served by a warm pool). One context serves any number of clients.
    """
    return httpx.create_ssl_context()
