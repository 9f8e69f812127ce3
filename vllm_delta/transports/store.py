"""An S3-compatible object store (endpoint and credentials from the standard AWS environment): the few calls
the sender and the engines need, in parallel parts, with botocore's standard retries (the only ones), and
errors as `DeltaError`s naming the object, never a credential; boto3 imported lazily."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from vllm_delta.wire.errors import DeltaError, LimitError

SCHEME = "s3://"
MIN_PART_BYTES = 5 << 20  # S3 refuses multipart parts below 5 MiB (all but the last)
AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken"}
AUTH_CODES |= {"InvalidClientTokenId", "AuthorizationHeaderMalformed", "403", "401"}
MISSING_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}

T = TypeVar("T")


@dataclass(frozen=True)
class StoreURL:
    """`s3://bucket/prefix`: where one sender's versions live."""

    bucket: str
    prefix: str  # no leading or trailing "/"; may be ""

    @classmethod
    def parse(cls, url: str) -> StoreURL:
        if not is_store_url(url):
            raise ValueError(f"not an s3:// URL: {url!r}")
        bucket, _, prefix = url[len(SCHEME) :].partition("/")
        if not bucket or "\\" in url or "\0" in url:
            raise ValueError(f"not an s3://BUCKET[/PREFIX] URL: {url!r}")
        prefix = prefix.strip("/")
        if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
            raise ValueError(f"empty, '.' or '..' segment in the store prefix: {url!r}")
        return cls(bucket, prefix)

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" if self.prefix else f"{SCHEME}{self.bucket}"


def is_store_url(value: str) -> bool:
    return str(value).startswith(SCHEME)


class StoreError(DeltaError):
    """The object store failed or could not be reached; `file` is the object key."""

    http_status = 502


class StoreNotFound(StoreError):
    """A missing object (or bucket): a delta that is not all there, like a missing file."""

    http_status = 400


class StoreAuthError(StoreError):
    """The store refused our credentials (401/403)."""


class ObjectStore:
    """One bucket/prefix of an S3-compatible store; thread-safe, like the boto3 client under it."""

    def __init__(
        self,
        url: StoreURL,
        *,
        max_concurrency: int = 8,
        part_bytes: int = 8 << 20,
        max_attempts: int = 8,
        throttle_bytes_per_s: float | None = None,
    ) -> None:
        import boto3
        from botocore.config import Config

        from vllm_delta.transports.base import Throttle

        self.url, self.part_bytes = url, part_bytes
        retries = {"mode": "standard", "max_attempts": max_attempts}
        config = Config(retries=retries, max_pool_connections=max(10, 2 * max_concurrency))
        self.client = boto3.session.Session().client("s3", config=config)
        self.endpoint = self.client.meta.endpoint_url or "the default endpoint"
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="vllm-delta-store")
        self._lock = threading.Lock()
        self._throttle = Throttle(throttle_bytes_per_s) if throttle_bytes_per_s else None
        self.uploaded_bytes = 0  # bytes PUT so far (every request that succeeded)

    def put(self, key: str, data: bytes) -> None:
        """One object; above `part_bytes` (at least S3's 5 MiB minimum) a multipart upload of
        parallel parts, aborted if any part fails so no partial object is left behind."""
        part = max(self.part_bytes, MIN_PART_BYTES)
        view = memoryview(data)

        def send(op: str, chunk: memoryview, **kwargs: Any) -> Any:
            if self._throttle is not None:
                with self._lock:  # one pace for all parts in flight: the link's rate, not a part's
                    self._throttle.wait(len(chunk))
            r = self._s3(key, op, Key=key, Body=bytes(chunk), **kwargs)
            with self._lock:
                self.uploaded_bytes += len(chunk)
            return r

        if len(view) <= part:
            send("put_object", view)
            return
        ids = {"UploadId": self._s3(key, "create_multipart_upload", Key=key)["UploadId"]}

        def one(n: int) -> dict[str, Any]:
            r = send("upload_part", view[n * part : (n + 1) * part], **ids, PartNumber=n + 1)
            return {"PartNumber": n + 1, "ETag": r["ETag"]}

        try:
            parts = list(self._pool.map(one, range(-(-len(view) // part))))
            self._s3(key, "complete_multipart_upload", Key=key, **ids, MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.url.bucket, Key=key, **ids)
            except Exception:  # the store is down: its own lifecycle rules reap the parts
                pass
            raise

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with `prefix` (end it with "/" for one directory)."""
        keys = self.list(prefix)
        for a in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[a : a + 1000]]
            r = self._s3(prefix, "delete_objects", Delete={"Objects": batch, "Quiet": True})
            if errors := r.get("Errors"):
                e = errors[0]
                raise StoreError(f"delete failed: {e.get('Code')} ({len(errors)} objects)", file=e.get("Key"))
        return len(keys)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """A whole object, in parallel ranged GETs of `part_bytes` pinned to one ETag (an object
        replaced mid-read is an error, never a mix). Above `max_bytes`: LimitError, nothing read."""
        size, etag = self.head(key)
        if max_bytes is not None and size > max_bytes:
            raise LimitError(f"object of {size} bytes exceeds the cap of {max_bytes}", file=key)
        out = bytearray(size)
        self.read_into(key, out, [(0, size)], etag=etag)
        return bytes(out)

    def read_into(
        self, key: str, out: bytearray, ranges: list[tuple[int, int]], *, etag: str | None = None
    ) -> int:
        """Bytes [start, end) of each range into the same offsets of `out`, in parallel GETs of at most
        `part_bytes` (pinned to `etag` if given); returns the bytes read."""
        step = self.part_bytes
        parts = [(a + i, min(b, a + i + step)) for a, b in ranges for i in range(0, b - a, step)]

        def one(part: tuple[int, int]) -> None:
            out[part[0] : part[1]] = self._get(key, *part, etag)

        list(self._pool.map(one, parts))
        return sum(b - a for a, b in parts)

    def get_range(self, key: str, start: int, end: int, *, etag: str | None = None) -> bytes:
        """Bytes [start, end) of an object (of the version `etag` names, if given)."""
        return self._get(key, start, end, etag) if end > start else b""

    def head(self, key: str) -> tuple[int, str | None]:
        """An object's size and ETag (StoreNotFound if absent)."""
        head = self._s3(key, "head_object", Key=key)
        return int(head["ContentLength"]), head.get("ETag")

    def list(self, prefix: str) -> list[str]:
        """Every key under `prefix` (a full key prefix, e.g. `url.key("v000005") + "/"`)."""
        pager = self.client.get_paginator("list_objects_v2")
        pages = self._call(prefix, lambda: list(pager.paginate(Bucket=self.url.bucket, Prefix=prefix)))
        return [o["Key"] for p in pages for o in p.get("Contents", [])]

    def check_access(self) -> None:
        """One cheap call that fails clearly on wrong credentials, a missing bucket or no store."""
        self._s3(str(self.url), "list_objects_v2", Prefix=self.url.key(""), MaxKeys=1)

    def _get(self, key: str, start: int, end: int, etag: str | None) -> bytes:
        kw = {"IfMatch": etag} if etag else {}
        r = self._s3(key, "get_object", Key=key, Range=f"bytes={start}-{end - 1}", **kw)
        data = self._call(key, r["Body"].read)
        if len(data) != end - start:
            raise StoreError(f"short read: {len(data)} of {end - start} bytes at {start}", file=key)
        return data

    def _s3(self, key: str, op: str, **kwargs: Any) -> Any:
        """The client's `op` on this bucket, its errors as `StoreError`s naming `key`."""
        return self._call(key, lambda: getattr(self.client, op)(Bucket=self.url.bucket, **kwargs))

    def _call(self, key: str, fn: Callable[[], T]) -> T:
        from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, NoCredentialsError
        from botocore.exceptions import ConnectionError as Unreachable

        try:
            return fn()
        except ClientError as exc:
            err, meta = exc.response.get("Error", {}), exc.response.get("ResponseMetadata", {})
            code, status = str(err.get("Code", "")), meta.get("HTTPStatusCode")
            if code in AUTH_CODES or status in (401, 403):
                why = f"the store at {self.endpoint} refused our credentials ({code or status}): check "
                why += "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE and the bucket's policy"
                raise StoreAuthError(why, file=key) from None
            if code == "NoSuchBucket":
                raise StoreNotFound(f"no such bucket ({self.url.bucket})", file=key) from None
            if code in MISSING_CODES or status == 404:
                raise StoreNotFound("no such object in the store", file=key) from None
            if code in ("PreconditionFailed", "412") or status == 412:
                raise StoreError("object replaced while it was being read", file=key) from None
            raise StoreError(f"store error {code or status} at {self.endpoint}", file=key) from None
        except NoCredentialsError:
            why = "no AWS credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
            raise StoreAuthError(why, file=key) from None
        except (Unreachable, HTTPClientError) as exc:
            why = f"store unreachable at {self.endpoint} ({type(exc).__name__}, after retries)"
            raise StoreError(why, file=key) from None
        except BotoCoreError as exc:
            raise StoreError(f"store client error: {type(exc).__name__}", file=key) from None
