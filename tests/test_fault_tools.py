"""Tests of the failure-drill tools in faults.py themselves, against the real things they stand in
front of: a moto S3 server on loopback (ThreadedMotoServer, as in test_s3), a real `ray start`
head with a second real node, and a real tmpfs mount.

The S3 clients are the real ones the pipeline uses: s3fs (aiobotocore over aiohttp) and boto3
(botocore over urllib3). Where a test counts failures it turns client retries off
(botocore `total_max_attempts=1`, s3fs `retries=1`) so that one call is one HTTP request.
"""
from __future__ import annotations

import base64
import errno
import http.client
import io
import logging
import os
import time
import urllib.request
import zlib

import boto3
import botocore.exceptions
import pytest
import s3fs
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials

from s3_util import moto_endpoint  # noqa: F401 -- the module's moto server fixture
from faults import (FAST_NODE_FAILURE_ENV, RayNode, S3FaultProxy, cluster_nodes, fill_until_full,
                    session_members, small_disk, wait_for_nodes)

BUCKET = "fault-tools"
KEY, SECRET, REGION = "fault-test-key", "fault-test-secret-7c1d", "us-east-1"
NO_RETRIES = {"total_max_attempts": 1, "mode": "standard"}       # one call = one request




def boto_client(url: str, retries: bool = False):
    config = Config(retries=None if retries else NO_RETRIES)
    return boto3.client("s3", endpoint_url=url, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                        region_name=REGION, config=config)


def s3fs_via(url: str, retries: bool = True) -> s3fs.S3FileSystem:
    """An uncached s3fs filesystem on `url`; retries=False: no botocore and no s3fs retries."""
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": url, "region_name": REGION},
                           skip_instance_cache=True, use_listings_cache=False,
                           config_kwargs={} if retries else {"retries": NO_RETRIES})
    if not retries:
        fs.retries = 1
    return fs


@pytest.fixture
def upstream(moto_endpoint):
    """A fresh moto store with one empty bucket; yields a boto3 client talking to moto directly
    (not through any proxy), to see what really landed upstream."""
    def reset():
        req = urllib.request.Request(f"{moto_endpoint}/moto-api/reset", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
    reset()
    client = boto_client(moto_endpoint)
    client.create_bucket(Bucket=BUCKET)
    yield client
    reset()


@pytest.fixture
def proxy(moto_endpoint, upstream):
    with S3FaultProxy(moto_endpoint, seed=1234) as p:
        yield p


def upstream_keys(client) -> set[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


# ---- S3FaultProxy ------------------------------------------------------------------------------------
def test_proxy_without_faults_is_transparent_to_s3fs(proxy, upstream, tmp_path):
    """put/get/ls/rm and a 3-part multipart upload (12 MiB + 123 B, 5 MiB parts) through the proxy,
    byte-exact, and the same bytes are on moto itself."""
    fs = s3fs_via(proxy.url)
    small = os.urandom(1000)
    fs.pipe(f"{BUCKET}/a/small.bin", small)
    big = os.urandom((12 << 20) + 123)
    (tmp_path / "big.bin").write_bytes(big)
    fs.put(str(tmp_path / "big.bin"), f"{BUCKET}/a/big.bin", chunksize=5 << 20)

    assert fs.cat(f"{BUCKET}/a/small.bin") == small
    fs.get(f"{BUCKET}/a/big.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == big
    assert fs.cat_file(f"{BUCKET}/a/big.bin", start=(5 << 20) - 10, end=(5 << 20) + 10) == \
        big[(5 << 20) - 10:(5 << 20) + 10]                              # a range read across parts
    assert sorted(fs.ls(f"{BUCKET}/a")) == [f"{BUCKET}/a/big.bin", f"{BUCKET}/a/small.bin"]
    assert fs.info(f"{BUCKET}/a/big.bin")["size"] == len(big)
    assert upstream.get_object(Bucket=BUCKET, Key="a/big.bin")["Body"].read() == big

    uploads = [r for r in proxy.history if r.target.startswith(f"/{BUCKET}/a/big.bin?")]
    assert [r.method for r in uploads if "uploads" in r.target.split("?")[1].split("&")] == ["POST"]
    assert sorted(r.target.split("partNumber=")[1].split("&")[0] for r in uploads if "partNumber=" in r.target) \
        == ["1", "2", "3"]

    fs.rm(f"{BUCKET}/a/small.bin")
    assert fs.ls(f"{BUCKET}/a") == [f"{BUCKET}/a/big.bin"]
    assert upstream_keys(upstream) == {"a/big.bin"}
    assert proxy.faults == 0 and proxy.forwarded == proxy.requests == len(proxy.history) > 0
    assert all(r.outcome == "forwarded" and r.status < 300 for r in proxy.history), proxy.history
    assert any(r.expect_continue for r in proxy.history)           # aiohttp sent Expect: 100-continue


def _signed_put(url: str, key: str, body, headers: dict, streaming_trailer: bool = False) -> tuple[int, bytes]:
    """A raw PUT by http.client with a SigV4 Authorization header from botocore (moto routes a
    request to S3 by its signature scope; it does not check the signature). `body` is bytes (sent
    with Content-Length) or an iterable of chunks (sent `Transfer-Encoding: chunked`)."""
    request = AWSRequest("PUT", f"{url}/{BUCKET}/{key}", headers=dict(headers), data=b"")
    if streaming_trailer:
        request.context["checksum"] = {"request_algorithm": {"in": "trailer", "name": "crc32"}}
    else:
        request.context["client_config"] = Config(s3={"payload_signing_enabled": False})
    S3SigV4Auth(Credentials(KEY, SECRET), "s3", REGION).add_auth(request)
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        sent = {k: v for k, v in request.headers.items()}
        if isinstance(body, bytes):
            conn.request("PUT", f"/{BUCKET}/{key}", body=body, headers=sent)
        else:
            conn.request("PUT", f"/{BUCKET}/{key}", body=iter(body), headers=sent, encode_chunked=True)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_proxy_relays_chunked_and_aws_chunked_bodies(proxy, upstream, moto_endpoint):
    """A `Transfer-Encoding: chunked` body, and an aws-chunked body (STREAMING-UNSIGNED-PAYLOAD-TRAILER
    with a CRC32 trailer) sent both with Content-Length and chunked: the proxy gives the same
    status as moto directly and moto stores the same decoded bytes."""
    plain = [b"hello ", b"chunked ", os.urandom(70_000), b" world"]
    payload = os.urandom(100_000)
    crc = base64.b64encode(zlib.crc32(payload).to_bytes(4, "big")).decode()
    aws_chunked = b"%x\r\n%s\r\n0\r\nx-amz-checksum-crc32:%s\r\n\r\n" % (len(payload), payload, crc.encode())
    aws_headers = {"Content-Encoding": "aws-chunked", "x-amz-decoded-content-length": str(len(payload)),
                   "x-amz-trailer": "x-amz-checksum-crc32"}
    for via, url in (("direct", moto_endpoint), ("proxy", proxy.url)):
        status, body = _signed_put(url, f"{via}/chunked", plain, {})
        assert status == 200, (via, body)
        status, body = _signed_put(url, f"{via}/aws-chunked-length", aws_chunked, aws_headers, streaming_trailer=True)
        assert status == 200, (via, body)
        pieces = [aws_chunked[i:i + 30_000] for i in range(0, len(aws_chunked), 30_000)]
        status, body = _signed_put(url, f"{via}/aws-chunked-te", pieces, aws_headers, streaming_trailer=True)
        assert status == 200, (via, body)
    for via in ("direct", "proxy"):
        get = lambda k: upstream.get_object(Bucket=BUCKET, Key=f"{via}/{k}")["Body"].read()   # noqa: E731
        assert get("chunked") == b"".join(plain)
        assert get("aws-chunked-length") == payload == get("aws-chunked-te")
    assert [r.framing for r in proxy.history] == ["chunked", "length", "chunked"]


def test_proxy_answers_expect_100_continue_for_botocore(proxy, upstream):
    """botocore (urllib3) sends `Expect: 100-continue` with a file-like body and waits for the
    100 before the body: forwarded, it gets one; failed, it gets the 503 instead and never sends
    the body; the next request works."""
    client = boto_client(proxy.url)
    data = os.urandom(3 << 20)
    client.put_object(Bucket=BUCKET, Key="expect", Body=io.BytesIO(data))
    assert proxy.history[-1].expect_continue and proxy.history[-1].status == 200
    proxy.outage("503")
    with pytest.raises(botocore.exceptions.ClientError) as err:
        client.put_object(Bucket=BUCKET, Key="expect-failed", Body=io.BytesIO(data))
    assert err.value.response["Error"]["Code"] == "SlowDown"
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert proxy.history[-1].expect_continue and proxy.history[-1].outcome == "503"
    proxy.restore()
    assert client.get_object(Bucket=BUCKET, Key="expect")["Body"].read() == data
    assert upstream_keys(upstream) == {"expect"}


def test_fail_share_503_fails_that_share_and_failed_puts_change_nothing(proxy, upstream):
    """400 PUTs at fail_share=0.3, mode "503", no client retries. Each request fails
    independently with p=0.3, so the number failed is Binomial(400, 0.3): mean 120, sd 9.2. We
    accept 72..168 (18%..42%); a correct proxy falls outside with probability 1.5e-7 (exact
    binomial tails: 1.4e-8 below, 1.4e-7 above) whatever the seed, while a proxy failing 50% of
    requests would pass with probability 8e-4 and one failing 10% with 8e-7. With the fixed seed
    the count is the same every run. Half the keys already hold "old" upstream: a failed PUT must leave "old"
    there, and a failed PUT of a new key must leave no object."""
    n = 400
    for i in range(0, n, 2):
        upstream.put_object(Bucket=BUCKET, Key=f"k/{i:03d}", Body=b"old")
    client = boto_client(proxy.url)
    proxy.fail_share, proxy.mode = 0.3, "503"
    failed = set()
    for i in range(n):
        try:
            client.put_object(Bucket=BUCKET, Key=f"k/{i:03d}", Body=b"new %d" % i)
        except botocore.exceptions.ClientError as err:
            assert err.response["Error"]["Code"] == "SlowDown"
            assert err.response["ResponseMetadata"]["HTTPStatusCode"] == 503
            failed.add(i)
    assert 72 <= len(failed) <= 168, len(failed)
    assert proxy.requests == n and proxy.faults == len(failed) == len(proxy.records("503"))
    assert proxy.forwarded == n - len(failed)

    proxy.fail_share = 0.0
    assert upstream_keys(upstream) == {f"k/{i:03d}" for i in range(n) if i % 2 == 0 or i not in failed}
    for i in range(n):
        if i % 2 == 0 or i not in failed:
            body = upstream.get_object(Bucket=BUCKET, Key=f"k/{i:03d}")["Body"].read()
            assert body == (b"old" if i in failed else b"new %d" % i), i


def test_same_seed_fails_the_same_requests(moto_endpoint, upstream):
    """Sequential requests through two proxies with one seed meet the same faults."""
    outcomes = []
    for _ in range(2):
        with S3FaultProxy(moto_endpoint, fail_share=0.5, mode="mixed", seed=99) as p:
            client = boto_client(p.url)
            for i in range(30):
                try:
                    client.head_bucket(Bucket=BUCKET)
                except (botocore.exceptions.ClientError, botocore.exceptions.HTTPClientError):
                    pass
            outcomes.append([r.outcome for r in p.history])
    assert outcomes[0] == outcomes[1] and {"forwarded", "503", "reset"} <= set(outcomes[0])


def test_outage_fails_everything_until_restore(proxy, upstream):
    """During outage() every request fails - s3fs (no retries) gets OSError EBUSY for a 503 - and
    nothing reaches moto; restore() ends it with fail_share still 0."""
    fs = s3fs_via(proxy.url, retries=False)
    fs.pipe(f"{BUCKET}/before", b"x")
    proxy.reset_counters()
    proxy.outage()
    assert proxy.in_outage
    calls = [lambda: fs.pipe(f"{BUCKET}/during", b"y"), lambda: fs.cat(f"{BUCKET}/before"),
             lambda: fs.ls(BUCKET), lambda: fs.rm(f"{BUCKET}/before"), lambda: fs.info(f"{BUCKET}/before")]
    for call in calls:
        with pytest.raises(OSError) as err:
            call()
        assert err.value.errno == errno.EBUSY, err.value           # s3fs's translation of a 503
    assert proxy.requests == proxy.faults == len(proxy.records("503")) >= len(calls)
    assert proxy.forwarded == 0
    assert upstream_keys(upstream) == {"before"}                    # no PUT or DELETE got through

    proxy.restore()
    assert not proxy.in_outage and proxy.fail_share == 0.0
    faults = proxy.faults
    fs.pipe(f"{BUCKET}/after", b"z")
    assert fs.cat(f"{BUCKET}/before") == b"x" and sorted(fs.ls(BUCKET)) == [f"{BUCKET}/after", f"{BUCKET}/before"]
    assert proxy.faults == faults


def test_fault_filter_limits_faults_to_matching_requests(proxy, upstream):
    """With fault_filter accepting only PUTs, an outage fails the PUTs and lets reads through."""
    client = boto_client(proxy.url)
    client.put_object(Bucket=BUCKET, Key="kept", Body=b"kept")
    proxy.fault_filter = lambda method, target: method == "PUT"
    proxy.outage()
    with pytest.raises(botocore.exceptions.ClientError):
        client.put_object(Bucket=BUCKET, Key="lost", Body=b"lost")
    assert client.get_object(Bucket=BUCKET, Key="kept")["Body"].read() == b"kept"
    assert [k["Key"] for k in client.list_objects_v2(Bucket=BUCKET)["Contents"]] == ["kept"]
    assert [(r.method, r.outcome) for r in proxy.history] == [
        ("PUT", "forwarded"), ("PUT", "503"), ("GET", "forwarded"), ("GET", "forwarded")]


def test_reset_mode_gives_connection_errors(proxy, upstream):
    """mode "reset": the connection is dropped (RST) without a response: botocore raises
    ConnectionClosedError, s3fs (aiohttp) EndpointConnectionError; neither sees an HTTP status.
    Nothing reaches moto. "mixed" gives both kinds."""
    proxy.outage("reset")
    client = boto_client(proxy.url)
    with pytest.raises(botocore.exceptions.ConnectionClosedError):
        client.put_object(Bucket=BUCKET, Key="reset", Body=b"x")
    fs = s3fs_via(proxy.url, retries=False)
    with pytest.raises((botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)):
        fs.pipe(f"{BUCKET}/reset", b"x")
    with pytest.raises((botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)):
        fs.ls(BUCKET)
    assert proxy.forwarded == 0 and proxy.faults == proxy.requests == len(proxy.records("reset"))
    assert upstream_keys(upstream) == set()

    proxy.restore()
    proxy.fail_share, proxy.mode = 1.0, "mixed"
    kinds = []
    for _ in range(40):
        try:
            client.head_bucket(Bucket=BUCKET)
        except botocore.exceptions.ClientError:
            kinds.append("503")
        except botocore.exceptions.HTTPClientError:
            kinds.append("reset")
    assert len(kinds) == 40 and 5 <= kinds.count("503") <= 35, kinds    # Binomial(40, .5): P(outside) 1.9e-7


def test_s3fs_retries_ride_through_a_fault_share(proxy, upstream):
    """s3fs with its default retries (botocore's and its own) writes and reads back 8 objects at
    fail_share=0.3 with mixed faults; the proxy did fail some of those requests."""
    fs = s3fs_via(proxy.url)
    proxy.fail_share, proxy.mode = 0.3, "mixed"
    blobs = {f"{BUCKET}/r/{i}": os.urandom(2000 + i) for i in range(8)}
    for path, data in blobs.items():
        fs.pipe(path, data)
    assert {p: fs.cat(p) for p in blobs} == blobs
    assert proxy.faults > 0
    proxy.fail_share = 0.0
    assert upstream_keys(upstream) == {p.split("/", 1)[1] for p in blobs}


# ---- two Ray nodes ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_second_node_joins_and_is_lost(monkeypatch):
    """A real head (1 CPU) and a RayNode (2 CPUs, custom resource node2): both alive with their
    CPUs. An actor pinned to node2 answers from the second node; after kill() (SIGKILL of its
    raylet) calls to it fail with RayActorError, the GCS reports the node dead within 30 s (about
    5 s with FAST_NODE_FAILURE_ENV, set here before the head starts), then the actor is
    ActorDiedError. stop() leaves none of the node's processes."""
    import ray
    from conftest import RayHead
    assert not ray.is_initialized(), "a Ray driver is already connected in this process"
    for name, value in FAST_NODE_FAILURE_ENV.items():
        monkeypatch.setenv(name, value)
    head = RayHead(num_cpus=1)
    node = None
    try:
        node = RayNode(head, num_cpus=2, resources={"node2": 1})
        nodes = wait_for_nodes(head, alive=2, timeout=60)
        cpus = sorted((n["is_head"], n["resources"].get("CPU")) for n in nodes.values() if n["alive"])
        assert cpus == [(False, 2.0), (True, 1.0)], nodes
        assert nodes[node.node_id]["resources"].get("node2") == 1.0

        ray.init(address=head.address, logging_level=logging.WARNING, log_to_driver=False)

        @ray.remote(num_cpus=0, resources={"node2": 1})
        class Where:
            def node(self):
                return ray.get_runtime_context().get_node_id()

        actor = Where.remote()
        assert ray.get(actor.node.remote(), timeout=60) == node.node_id

        node.kill()
        deadline = time.monotonic() + 30
        while True:                          # calls may still land on the worker until it exits
            try:
                ray.get(actor.node.remote(), timeout=10)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, "actor still answers 30 s after its node was killed"
            time.sleep(0.1)
        wait_for_nodes(head, alive=1, dead_ids=[node.node_id], timeout=30)
        declared_dead_s = time.monotonic() - node.killed_at
        with pytest.raises(ray.exceptions.ActorDiedError):
            ray.get(actor.node.remote(), timeout=30)
        print(f"node declared dead {declared_dead_s:.1f} s after its raylet was killed")
        assert not cluster_nodes(head)[node.node_id]["alive"]
    finally:
        ray.shutdown()
        if node is not None:
            node.stop()
            assert session_members(node.proc.pid) == []
            assert not os.path.exists(node.temp_dir)
        head.stop()


# ---- small disk -------------------------------------------------------------------------------------
def test_small_disk_fills_up_with_enospc():
    """A 4 MiB tmpfs: writes stop with ENOSPC after at most 4 MiB; unmounted and removed on exit."""
    with small_disk(4) as disk:
        assert any(line.split()[1] == str(disk) and line.split()[2] == "tmpfs"
                   for line in open("/proc/mounts"))
        written = fill_until_full(disk)
        assert (3 << 20) <= written <= (4 << 20), written
        with pytest.raises(OSError) as err:
            with open(disk / "more.bin", "wb") as f:
                f.write(os.urandom(1 << 20))
        assert err.value.errno == errno.ENOSPC
    assert not any(line.split()[1] == str(disk) for line in open("/proc/mounts"))
    assert not disk.exists()


def test_small_disk_skips_with_the_mount_error(monkeypatch):
    """Where `mount` fails, small_disk skips with mount's exit status and message."""
    import faults
    monkeypatch.setattr(faults.shutil, "which", lambda name: "/bin/false" if name == "mount" else None)
    with pytest.raises(pytest.skip.Exception) as skipped:
        with small_disk(4):
            pass
    assert "`mount` exited 1" in str(skipped.value)
