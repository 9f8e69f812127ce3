"""Fuzz harnesses: one function per parser of untrusted bytes, each taking the raw input.

What each checks (a violation raises `Finding`, or lets the foreign exception out, so the fuzzer
keeps the input):
- only the project's errors escape (`DeltaError`): never a TypeError, RecursionError, MemoryError;
- the decode paths agree: a block-indexed flush decoded per param (the reference), in batches on the
  host, and in batches by the "device" decoder (wire/batch_device.py, torch ops on the CPU here)
  gives the same changes bit for bit, or all of them refuse it;
- memory stays within what the manifest allows (`allowed`): numpy's and Python's allocations are
  counted by tracemalloc where a caller traces (the property tests), else each input's growth of
  the peak resident size (the coverage-guided runs, with libFuzzer's `-rss_limit_mb` behind it).

Used by tests/fuzz/run.py (atheris, `make fuzz`) and tests/fuzz/test_fuzz.py (hypothesis, light).
"""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from fuzz_corpus import changes, model

from vllm_delta.wire import (
    ENCODINGS,
    DeltaDecoder,
    DeltaError,
    FormatError,
    bytes_digest,
    flush,
    parse_manifest,
)
from vllm_delta.wire.batch import Fallback
from vllm_delta.wire.batch_device import Decoder
from vllm_delta.wire.container import Limits, json_loads
from vllm_delta.wire.flush import open_flush
from vllm_delta.wire.flush_meta import Rows, heads_from_text, parse_params
from vllm_delta.wire.seed_format import decode_seed_flush, seed_checksum

FILE = "rank0000_flush000000.safetensors"
MODEL = model()
EXPECTED = {name: (t.shape, t.dtype) for name, t in MODEL.items()}
NUMEL = sum(t.numel() for t in MODEL.values())
OWNED = {"big": [(100, 900), (2000, 2100), (3000, 4095)], "e1": [], "e2": [(0, 40)]}


class Finding(AssertionError):
    """A harness's property failed (not an exception the parser raised)."""


def allowed(decoded: int, size: int) -> int:
    """Bytes a decode may hold at once: a small multiple of what the manifest lets it decompress
    and of the file, plus the decoded changes of the whole model (positions and values, int64)."""
    return (4 << 20) + 8 * (decoded + size) + 32 * NUMEL


RSS_SLACK = 64 << 20  # the coverage-guided runs: allocator arenas and first-touched pages
_warm: list[bool] = []  # set by `warm_up`: imports and compiled kernels are loaded, so RSS is comparable


def warm_up(inputs: dict[str, list[bytes]]) -> None:
    """Run each harness's seeds once (its first call loads modules and compiles kernels: ~100 MB of
    resident size that no input is to blame for), then hold every input to its RSS bound."""
    for name, seeds in inputs.items():
        for data in seeds:
            HARNESSES[name](data)
    _warm.append(True)


@contextmanager
def bounded(limit: int) -> Iterator[None]:
    """Fail if the body held more than `limit` bytes at once (see the module's docstring). Without
    tracemalloc, the process's peak resident size is reset first (Linux: /proc/self/clear_refs) and
    read after, so each input is held to its own bound however large the fuzzer itself grows."""
    if tracemalloc.is_tracing():
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        yield
        peak = tracemalloc.get_traced_memory()[1] - base
        if peak > limit:
            raise Finding(f"held {peak} B at once, the manifest allows {limit} B")
        return
    if not _warm:
        yield
        return
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS")
    yield
    peak = _status("VmHWM") - base
    if peak > limit + RSS_SLACK:
        raise Finding(f"resident size grew {peak} B, the manifest allows {limit} B")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return 1024 * int(next(line for line in f if line.startswith(field + ":")).split()[1])


def manifest(data: bytes) -> None:
    """parse_manifest, and the decoder's tables made from what it accepts."""
    try:
        m = parse_manifest(data)
        DeltaDecoder(m, expected=EXPECTED, current_version=0)
    except DeltaError:
        pass


def _manifest_for(encoding: str, data: bytes, decoded: int):
    """The template manifest (the corpus's params), listing `data` as its one flush."""
    counts = {name: int(c[0].numel()) for name, c in changes(MODEL).items()}
    return parse_manifest(
        json.dumps(
            {
                "format": "vllm-delta/1",
                "version": 1,
                "base_version": 0,
                "encoding": encoding,
                "hash_algo": "xxh3_128",
                "files": [
                    {"name": FILE, "bytes": len(data), "hash": bytes_digest(data), "decoded_bytes": decoded}
                ],
                "params": [
                    {
                        "name": n,
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                        "changed": counts[n],
                        "files": [FILE],
                    }
                    for n, t in MODEL.items()
                ],
            }
        ).encode()
    )


def _outcome(decode: Callable[[], list]) -> tuple | None:
    """The decoded changes as comparable bytes, or None where a project error refused the input."""
    try:
        got = decode()
    except DeltaError:
        return None
    return tuple(
        (
            d.name,
            tuple(d.shape),
            d.dtype,
            d.skipped,
            d.bounds,
            d.blocks,
            d.positions.cpu().numpy().tobytes(),
            _bytes(d.values),
        )
        for d in got
    )


def _bytes(t: torch.Tensor) -> bytes:
    """A tensor's elements' bytes (a fresh copy: a decoder may hand out an expanded view)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).view(torch.uint8).numpy().tobytes()


def flush_file(data: bytes) -> None:
    """A flush file (after 4 bytes: the flags byte and the manifest's decoded_bytes, fuzzer-chosen too)
    decoded per param, in host batches and in device batches, all to the same result."""
    if len(data) < 4:
        return
    encoding = list(ENCODINGS)[(data[0] & 7) % len(ENCODINGS)]
    owned = OWNED if data[0] & 8 else None
    decoded = int.from_bytes(data[1:4], "little") & 0x3FFFF
    body = data[4:]
    m = _manifest_for(encoding, body, decoded)

    def run(decoder=None) -> list:
        dec = DeltaDecoder(
            m, expected=EXPECTED, current_version=0, **({} if decoder is None else {"decoder": decoder})
        )
        out = list(dec.feed_iter(FILE, body, owned=owned))
        dec.finish()
        return out

    def per_param() -> list:
        was = flush.index_flush
        flush.index_flush = _refuse
        try:
            return run()
        finally:
            flush.index_flush = was

    def device() -> list:
        decoder = Decoder({n: torch.device("cpu") for n in MODEL})
        out = run(decoder)
        decoder.verify()
        return out

    with bounded(allowed(decoded, len(body))):
        ref = _outcome(per_param)
        host = _outcome(run)
        dev = _outcome(device)
    if host != ref:
        raise Finding(
            f"host batches {'refused' if host is None else 'decoded'} what the per-param path did not"
        )
    if dev != ref:
        raise Finding(
            f"device batches {'refused' if dev is None else 'decoded'} what the per-param path did not"
        )


def _refuse(*args, **kwargs):
    raise Fallback


def params(data: bytes) -> None:
    """The compiled params scanner (kernels/params_jit.py via heads_from_text) gives None or exactly
    the JSON path's columns; the JSON path refuses with FormatError only."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    got = heads_from_text(text)
    try:
        heads = parse_params(json_loads(text), blocked=True, file="f")
    except ValueError:  # not JSON (json.JSONDecodeError): the reader's meta_json makes it a FormatError
        if got is not None:
            raise Finding("the scanner read columns from text that is not JSON") from None
        return
    except DeltaError:
        if got is not None:
            raise Finding("the scanner read columns the JSON path refuses") from None
        return
    if got is None:
        return
    rows = Rows.of(heads.blocks)
    if rows is None:
        raise Finding("the scanner read rows the JSON path leaves to the per-param path")
    if _fields(got, got.rows) != _fields(heads, rows):
        raise Finding("the scanner's columns differ from the JSON path's")


def _fields(heads, rows) -> tuple:
    return (
        list(heads.name),
        list(heads.dtype),
        [tuple(s) for s in heads.shape],
        list(heads.count),
        list(heads.width),
        [tuple(s) for s in heads.streams],
        *(getattr(rows, f).tolist() for f in ("nrows", "head", "frames", "lens")),
    )


def gaps(data: bytes) -> None:
    """The gap decoder: strictly increasing positions inside the tensor, or a `DeltaError`.
    Input: the gap width, a numel byte (numel = 1 + byte^3), then the gaps."""
    if len(data) < 2:
        return
    width = data[0]
    numel = 1 + data[1] ** 3
    body = data[2:]
    try:
        count = len(body) // width if width else 0
        spans = {"positions": memoryview(body)}
        pos = ENCODINGS["deltas"].positions.decode(spans, count, width, numel, file="f", param="p")
    except DeltaError:
        return
    if pos.size and (pos[0] < 0 or pos[-1] >= numel or (np.diff(pos) <= 0).any()):
        raise Finding("the gap decoder gave positions outside the tensor or out of order")


def seed(data: bytes) -> None:
    """A seed-format flush, its checksum made to match (anyone can compute it: it has no key)."""
    limits = Limits(max_decoded_bytes=1 << 20)
    with bounded(allowed(limits.max_decoded_bytes, len(data))):
        try:
            tensors, meta, _ = open_flush(data, file=FILE, limits=limits)
            pos, val = tensors.get("__positions__"), tensors.get("__values__")
            if pos is not None and val is not None:
                meta["checksum"] = str(seed_checksum(pos.data, val.data, val.dtype))
            decode_seed_flush(tensors, meta, file=FILE, expected=EXPECTED)
        except DeltaError:
            pass


HARNESSES: dict[str, Callable[[bytes], None]] = {
    "manifest": manifest,
    "flush": flush_file,
    "params": params,
    "gaps": gaps,
    "seed": seed,
}

__all__ = ["HARNESSES", "Finding", "FormatError"]
