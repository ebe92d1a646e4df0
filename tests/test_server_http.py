"""The HTTP/1.1 parser `corral serve` runs with: uvicorn's httptools, never h11's pure-Python head parser, whose
header pattern is quadratic on some malformed lines (seconds of CPU for one 16 KiB line) and is reached before
any authentication."""

from __future__ import annotations

from fastapi import FastAPI
from uvicorn.config import Config


def test_the_server_parses_http_with_httptools() -> None:
    config = Config(FastAPI(), http="auto")  # what corral serve uses
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
