"""A real S3-compatible store on loopback for tests and benchmarks: moto's server mode, IAM enforced.

Why moto: it installs from PyPI with `make install` (`moto[server]` in the dev extra), speaks the S3
REST API over real HTTP (boto3 in the sender and in the engines talks to it as it would to AWS), and
enforces request signatures once told to (`/moto-api/reset-auth`), so wrong keys fail for real
(403 SignatureDoesNotMatch / InvalidAccessKeyId) while the keys of the IAM user made here work.

By default the server runs in this process (moto's `ThreadedMotoServer`, up in about a millisecond).
moto's backends are process-global, so `stop()` (the listening socket closed: connections refused)
and `start()` on the same port keep every object: the "store unavailable mid-upload" fault.
`process=True` runs `moto_server` as a subprocess instead (its own core, pinnable with taskset: the
benchmark), which cannot be restarted with its objects.
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from harness.vllm_engine import free_port, patched_environ

BUCKET = "vllm-delta-test"
REGION = "us-east-1"
ALLOW_S3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}


class S3Server:
    """moto's S3 on `127.0.0.1:port`, one bucket, one IAM user whose keys `env()` hands out."""

    def __init__(self, bucket: str = BUCKET, *, process: bool = False, cpus: str | None = None) -> None:
        self.bucket, self.process, self.cpus = bucket, process, cpus
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread_server = None
        self._proc: subprocess.Popen | None = None
        self.start()
        # moto's auth switch is process-wide (another store here may already enforce it): lift it.
        requests.post(f"{self.endpoint}/moto-api/reset-auth", data="inf", timeout=10).raise_for_status()
        # Before auth is enforced any key is accepted: make the bucket and the user, then enforce.
        setup = self.client(access_key="AKIASETUPSETUPSETUP0", secret_key="setup")
        setup.create_bucket(Bucket=bucket)
        iam = self.client("iam", access_key="AKIASETUPSETUPSETUP0", secret_key="setup")
        user = f"trainer-{self.port}"  # IAM users, like the auth switch, are shared by the process
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(ALLOW_S3))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        requests.post(f"{self.endpoint}/moto-api/reset-auth", data="0", timeout=10).raise_for_status()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Listen on the same port again (in-process: with every object kept)."""
        if self.process:
            if self._proc is not None:
                raise RuntimeError("a moto_server subprocess cannot be restarted with its objects")
            cmd = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]
            if self.cpus:
                cmd = ["taskset", "-c", self.cpus, *cmd]
            self._proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
            self._wait_up()
            return
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
        self._thread_server = ThreadedMotoServer("127.0.0.1", self.port, verbose=False)
        self._thread_server.start()

    def stop(self) -> None:
        """Stop serving and close the listening socket, so a client's connect is refused (not left
        hanging)."""
        if self.process:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.terminate()
                self._proc.wait(30)
            return
        if self._thread_server is not None:
            self._thread_server.stop()
            self._thread_server._server.server_close()  # stop() alone leaves the socket listening
            self._thread_server = None

    def _wait_up(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self._proc.returncode}")
            with contextlib.suppress(requests.RequestException):
                requests.get(f"{self.endpoint}/moto-api/", timeout=2)
                return
            time.sleep(0.1)
        raise TimeoutError(f"moto_server not up on {self.endpoint} after {timeout_s:.0f}s")

    # ---- what clients need --------------------------------------------------------------------
    def env(
        self, *, access_key: str | None = None, secret_key: str | None = None, endpoint: str | None = None
    ) -> dict[str, str]:
        """The standard AWS variables a sender or an engine reads (botocore honours AWS_ENDPOINT_URL)."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": access_key or self.access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key or self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    def url(self, name: str = "") -> str:
        """A store URL under a prefix of its own (`s3://bucket/<name>-<random>`): tests never share keys."""
        return f"s3://{self.bucket}/{name or 'run'}-{uuid.uuid4().hex[:8]}"

    def client(self, service: str = "s3", *, access_key: str | None = None, secret_key: str | None = None):
        """A plain boto3 client on this server, independent of the code under test (for checks and faults)."""
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
        )

    def sizes(self, prefix: str) -> dict[str, int]:
        """Every key under `prefix` and its size, listed by a plain boto3 client."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}

    def keys(self, prefix: str) -> list[str]:
        return sorted(self.sizes(prefix))

    def close(self) -> None:
        self.stop()


def prefix_of(url: str) -> str:
    """`s3://bucket/a/b` -> `a/b`."""
    return url.split("://", 1)[1].split("/", 1)[1]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session's store (in-process moto, IAM enforced); every test takes a prefix of its own (`url()`)."""
    server = S3Server()
    yield server
    server.close()


@pytest.fixture
def s3_env(s3_server: S3Server) -> Iterator[S3Server]:
    """The store's endpoint and keys in os.environ for this test (the sender in this process reads them)."""
    with patched_environ(s3_server.env()):
        yield s3_server
