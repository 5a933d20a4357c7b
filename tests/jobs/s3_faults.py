"""An HTTP proxy in front of the test S3 server that answers chosen PUTs with ``503 Service Unavailable``.

The client under test talks to the proxy as it would to S3 (``AWS_ENDPOINT_URL``), so the retries exercised are
the ones users get: botocore's, then ``cbrun.jobs.store.files.retried``'s.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
    b"<Message>injected by the test</Message></Error>"
)


class FaultyProxy:
    """Forwards every request to ``upstream``; a PUT for which ``fail_puts(n, path)`` is true gets a 503 instead.

    ``n`` counts the earlier PUTs of part objects (``/part-`` outside ``_cbrun/``), tries included, so a test can fail "every other part
    PUT" or "every part PUT after the second". Used as a context manager; ``endpoint`` is its URL.
    """

    def __init__(self, upstream: str, fail_puts: Callable[[int, str], bool]):
        self.upstream = urlsplit(upstream)
        self.fail_puts = fail_puts
        self.num_failed = 0
        self._part_puts = 0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FaultyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _should_fail(self, method: str, path: str) -> bool:
        if method != "PUT":
            return False
        with self._lock:
            n = self._part_puts
            if "/part-" in path and "/_cbrun/" not in path:
                self._part_puts += 1
            fail = self.fail_puts(n, path)
            self.num_failed += fail
        return fail

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy._should_fail(self.command, self.path):
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                connection = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = proxy.upstream.netloc
                connection.request(self.command, self.path, body=body, headers=headers)
                reply = connection.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                # NOTE: a HEAD reply's Content-Length is the object's size, kept as the server said it
                dropped = ("transfer-encoding", "connection") + (() if self.command == "HEAD" else ("content-length",))
                for key, value in reply.getheaders():
                    if key.lower() not in dropped:
                        self.send_header(key, value)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler
