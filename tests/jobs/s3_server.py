"""A real S3 server on this machine for the object-store tests: moto's server mode on 127.0.0.1, a free port.

It speaks the S3 protocol over HTTP, so the code under test is the code users run against S3. The fixture sets the
standard AWS environment (``AWS_ENDPOINT_URL`` and test credentials) for this process and the subprocesses it
starts, and makes an empty bucket per test.
"""

from __future__ import annotations

import itertools
import socket
from dataclasses import dataclass

import pytest

_bucket_numbers = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    """A running moto server: its endpoint, a fresh bucket, and ``restart``."""

    server: object
    port: int
    bucket: str

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def restart(self) -> None:
        """Stop the server and start it again on the same port; moto keeps its objects in this process."""
        from moto.server import ThreadedMotoServer

        self.server.stop()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")


@pytest.fixture(scope="module")
def _moto_server():
    moto_server = pytest.importorskip("moto.server", reason="the object-store tests need moto[server] (extra: test)")
    pytest.importorskip("s3fs", reason="the object-store tests need s3fs (extra: cloud)")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    holder = S3Server(server, port, "")
    yield holder
    holder.server.stop()


@pytest.fixture
def s3(_moto_server, monkeypatch):
    """A moto S3 server with a new empty bucket; the AWS environment points at it."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": _moto_server.endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    _moto_server.bucket = f"cbrun-test-{next(_bucket_numbers)}"
    _moto_server.client().create_bucket(Bucket=_moto_server.bucket)
    return _moto_server
