"""A real S3 protocol server on loopback for the tests: moto's ThreadedMotoServer (HTTP, SigV4), dummy
credentials, the test bucket, and a reset between tests (what s3fs's own tests do). Fixtures
`moto_endpoint` (one server per module) and `s3` (an empty bucket, AWS_* of the environment cleared)."""
from __future__ import annotations

import logging
import urllib.request

import boto3
import pytest
import s3fs
from moto.server import ThreadedMotoServer


BUCKET = "specpipe-test"
KEY, SECRET, REGION = "specpipe-test-key", "specpipe-test-secret-3b9f", "us-east-1"


AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE")


@pytest.fixture(scope="module")
def moto_endpoint():
    """One moto S3 server on loopback for the module, started and stopped here."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)              # one log line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def _reset(endpoint: str) -> None:
    req = urllib.request.Request(f"{endpoint}/moto-api/reset", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    """A fresh store with one empty bucket; no AWS_* variables in this process unless a test sets
    them. Yields an uncached s3fs filesystem for setup and checks (not shared with the job's)."""
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    _reset(moto_endpoint)
    client = boto3.client("s3", endpoint_url=moto_endpoint, aws_access_key_id=KEY,
                          aws_secret_access_key=SECRET, region_name=REGION)
    client.create_bucket(Bucket=BUCKET)
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": moto_endpoint},
                           skip_instance_cache=True, use_listings_cache=False)
    yield fs
    _reset(moto_endpoint)

