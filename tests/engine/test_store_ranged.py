"""Each TP rank fetches only the byte ranges of the position blocks it owns, where that is safe.

Why in-process: the sparse fetch, the decoder and the route's cross-rank digest check are plain
Python over a real S3 server (moto on loopback, harness/s3_server.py); the workers are the real
worker extension on two TP ranks of the tiny model. The bytes each rank GETs are counted by a
botocore event hook on its client, and the corrupted offsets are found by parsing the flush's
safetensors header here, independently of the code under test.
"""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.s3_server import s3_env, s3_server  # noqa: F401  (fixtures: a real local store)
from harness.synthetic import InProcessEngine, device_check, loaded, same_bits, tp_ranks

from vllm_delta.engine.http_errors import UpdateError
from vllm_delta.engine.request import DeltaUpdateRequest
from vllm_delta.engine.routes import DeltaUpdater
from vllm_delta.settings import UPDATES_ROOT as ROOT_ENV
from vllm_delta.transports import s3
from vllm_delta.transports.store import ObjectStore, StoreURL
from vllm_delta.wire import DeltaDecoder, DeltaWriter, load_manifest, write_manifest
from vllm_delta.wire.additive import partial_sum, to_hex
from vllm_delta.wire.blocks import Policy
from vllm_delta.wire.container import SparseFile
from vllm_delta.wire.errors import IntegrityError

DC = device_check()
CFG = DC.SIZES["tiny"]
CHANGED = ["model.embed_tokens.weight", "lm_head.weight"]  # vocab-parallel: each rank owns a row half
POLICY = Policy(span_bits=4, min_entries=64, max_entries=128)  # 16 blocks per tensor of 1024


def write_delta(
    path: Path, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], *, digests: bool
) -> str:
    """Version 1 (every element of CHANGED) in one block-indexed flush; its name."""
    with DeltaWriter(path, version=1, base_version=0, encoding="planes_zstd", block_policy=POLICY) as w:
        for name in CHANGED:
            a, b = old[name].reshape(-1), new[name].reshape(-1)
            pos = torch.nonzero(a.view(torch.int16) != b.view(torch.int16)).squeeze(1)
            w.add(name, pos, b[pos], shape=tuple(new[name].shape))
        manifest = w.manifest()
    if digests:  # what the sender states: the additive digest of the new values at the changed positions
        post = {}
        for name in CHANGED:
            flat = new[name].reshape(-1)
            pos = torch.nonzero(old[name].reshape(-1).view(torch.int16) != flat.view(torch.int16)).squeeze(1)
            post[name] = to_hex(partial_sum(pos, flat[pos]))
        manifest = manifest.model_copy(
            update={"params": [p.model_copy(update={"post_digest": post[p.name]}) for p in manifest.params]}
        )
    write_manifest(path, manifest)
    assert [f.name for f in manifest.files] == ["rank0000_flush000000.safetensors"]
    return manifest.files[0].name


class RecordingEngine(InProcessEngine):
    """The in-process engine, keeping each rank's final prepare reply."""

    def __init__(self, workers) -> None:
        super().__init__(workers)
        self.prepared: list[dict[str, Any]] = []

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        replies = await super().collective_rpc(method, args)
        if method == "delta_prepare_poll":  # ranks finish in different polls
            self.prepared += [r for r in replies if r.get("done")]
        return replies


def counted_store(url: StoreURL) -> ObjectStore:
    """A rank's store client whose GetObject body bytes are counted from the HTTP responses."""
    store = ObjectStore(url)
    store.got = store.gets = 0

    def count(http_response, parsed, **_) -> None:
        if http_response.status_code in (200, 206):
            store.got += int(http_response.headers["Content-Length"])
            store.gets += 1

    store.client.meta.events.register("after-call.s3.GetObject", count)
    return store


@pytest.fixture
def setup(tmp_path, s3_env, monkeypatch):
    """(make, base, new): make(digests) uploads version 1 under a fresh prefix and returns two TP
    ranks on the checkpoint with an updater rooted there."""
    # Tiny flushes: the 64 KiB defaults would read the whole file in the first GET and merge all ranges.
    monkeypatch.setattr(s3, "HEAD_BYTES", 8)  # the size field, then the header in a second GET
    monkeypatch.setattr(s3, "MERGE_GAP", 0)
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = dict(base)
    for k, name in enumerate(CHANGED):
        new[name] = base[name] + torch.randn(
            base[name].shape, generator=torch.Generator().manual_seed(k), dtype=torch.float32
        ).to(base[name].dtype)
    counter = iter(range(100))

    def make(digests: bool = True, corrupt: str | None = None, tp: int = 2):
        n = next(counter)
        url = StoreURL.parse(s3_env.url(f"ranged{n}"))
        monkeypatch.setenv(ROOT_ENV, str(url))
        models, workers = tp_ranks(tmp_path / f"model{n}", base, tp=tp)
        name = write_delta(tmp_path / f"v{n}", base, new, digests=digests)
        client = s3_env.client()
        for f in [name, "manifest.json"]:
            data = (tmp_path / f"v{n}" / f).read_bytes()
            if f == name and corrupt is not None:
                at = block_byte(data, corrupt)
                data = data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]
            client.put_object(Bucket=url.bucket, Key=url.key("v000001", f), Body=data)
        for w in workers:
            w._delta_store = counted_store(url)
        sizes = {f: (tmp_path / f"v{n}" / f).stat().st_size for f in [name, "manifest.json"]}
        return DeltaUpdater(RecordingEngine(workers), url, 1 << 20, []), models, workers, sizes

    return make, base, new


def block_byte(data: bytes, which: str) -> int:
    """A byte in the middle of the first embedding block's value frame ("first": rank 0's) or of
    its last ("last": rank 1's), found from the safetensors header."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    params = json.loads(header["__metadata__"]["params"])
    p = params[0]
    assert p["name"] == CHANGED[0] and len(p["blocks"]) == 16
    j = len(p["streams"]) - 1  # the last stream: value planes
    stream = p["streams"][j]
    lengths = [row[3][2 * j] for row in p["blocks"]]
    k = 0 if which == "first" else len(lengths) - 1
    start = 8 + n + header[f"__{stream}__"]["data_offsets"][0] + sum(lengths[:k])
    return start + lengths[k] // 2


def pull(updater: DeltaUpdater) -> dict:
    return asyncio.run(updater.update(DeltaUpdateRequest(path="v000001", version=1, base_version=0)))


def is_new(models, new) -> bool:
    return all(same_bits(m, loaded(new, rank, 2)) == [] for rank, m in enumerate(models))


def test_each_rank_fetches_only_its_blocks_and_applies_exactly(setup):
    make, base, new = setup
    updater, models, workers, sizes = make()
    result = pull(updater)
    flush = sizes["rank0000_flush000000.safetensors"]
    for rank, w in enumerate(workers):
        got = w._delta_store.got - sizes["manifest.json"]
        assert 0 < got < 0.75 * flush, (rank, got, flush)  # header + about half of the blocks
        assert result["ranks"][rank]["bytes_read"] == w._delta_store.got  # every GET byte counted
    assert is_new(models, new)
    # The same delta fetched whole (sparse never pays above a share of 0) gives the same bits.
    s3.SPARSE_MAX_SHARE, share = 0.0, s3.SPARSE_MAX_SHARE
    try:
        whole, whole_models, whole_workers, _ = make()
        pull(whole)
    finally:
        s3.SPARSE_MAX_SHARE = share
    assert [w._delta_store.got for w in whole_workers] == [sum(sizes.values())] * 2
    assert all(same_bits(a, b) == [] for a, b in zip(models, whole_models))


def test_a_delta_without_digests_is_fetched_whole(setup):
    make, _, new = setup
    updater, models, workers, sizes = make(digests=False)
    result = pull(updater)
    assert [r["bytes_read"] for r in result["ranks"]] == [sum(sizes.values())] * 2
    assert [w._delta_store.got for w in workers] == [sum(sizes.values())] * 2
    assert is_new(models, new)


def test_a_rank_that_owns_everything_fetches_whole(setup):
    make, _, new = setup
    updater, models, workers, sizes = make(tp=1)
    pull(updater)
    assert workers[0]._delta_store.got == sum(sizes.values())
    assert workers[0]._delta_store.gets == 2  # the manifest, the flush: no ranged reads of its header first
    assert same_bits(models[0], loaded(new, 0, 1)) == []


# The first block's values are stored raw inside their frame: the flip decodes to a wrong value, which
# the route's check of the ranks' partial post digests refuses (the encoder writes no zstd checksums).
# The last block's are entropy-coded: the owner's zstd decoder refuses the frame itself.
REFUSED_BY = {"first": "IntegrityError", "last": "FormatError"}


@pytest.mark.parametrize("which", REFUSED_BY)
def test_a_corrupted_owned_block_is_refused_and_an_unowned_one_is_not_seen(setup, which):
    make, base, _ = setup
    updater, models, _, sizes = make(corrupt=which)
    with pytest.raises(UpdateError) as err:
        pull(updater)
    assert err.value.status == 400 and err.value.error["type"] == REFUSED_BY[which]
    assert err.value.error["param"] == CHANGED[0]
    assert all(same_bits(m, loaded(base, rank, 2)) == [] for rank, m in enumerate(models))
    assert not updater.engine.paused and updater.fault is None
    blind = 1 if which == "first" else 0  # the rank that does not own the corrupted block
    reply = next(r for r in updater.engine.prepared if r.get("rank") == blind)
    assert reply["ok"]  # it never read the byte; the owner (or the digest check) refused
    assert reply["bytes_read"] < sum(sizes.values())


def test_the_decoder_refuses_a_sparse_file_without_post_digests(tmp_path):
    base = DC.random_checkpoint(CFG, "cpu", seed=0)
    new = {**base, **{n: -base[n] for n in CHANGED}}
    name = write_delta(tmp_path, base, new, digests=False)
    data = (tmp_path / name).read_bytes()
    sparse = SparseFile(len(data))
    sparse[:] = data
    decoder = DeltaDecoder(load_manifest(tmp_path))
    with pytest.raises(IntegrityError) as err:
        decoder.feed(name, sparse)
    assert err.value.file == name


def test_an_anchor_flush_of_implicit_positions_is_fetched_by_its_blocks(tmp_path):
    """An anchor's dense ranges carry no positions (width 0); their blocks are still ranged: the
    bytes fetched for one half of the rows decode to exactly that half's new values."""
    name, values = (
        CHANGED[0],
        torch.randn(1024, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16),
    )
    with DeltaWriter(tmp_path, version=1, base_version=0, encoding="planes_zstd", block_policy=POLICY) as w:
        # Two runs of odd lengths: implicit blocks need not hold a multiple of 8 entries, explicit ones must.
        w.add_dense(name, [(0, values[:501]), (601, values[601:])], shape=(1024,))
        manifest = w.manifest()
    manifest = manifest.model_copy(
        update={"params": [p.model_copy(update={"post_digest": "0" * 32}) for p in manifest.params]}
    )
    write_manifest(tmp_path, manifest)
    (flush,) = [f.name for f in manifest.files]
    data = (tmp_path / flush).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    owned = {name: [(0, 511)]}
    ranges = s3.block_ranges(data[: 8 + n], owned)
    assert ranges is not None  # not "fetch the whole file"
    sparse = SparseFile(len(data))
    sparse[: 8 + n] = data[: 8 + n]
    for a, b in ranges:
        sparse[a:b] = data[a:b]
    assert sum(b - a for a, b in ranges) < len(data) - 8 - n
    (delta,) = DeltaDecoder(load_manifest(tmp_path)).feed(flush, sparse, owned=owned)
    keep = delta.positions <= 511
    assert torch.equal(delta.positions[keep], torch.arange(501))
    assert torch.equal(delta.values[keep].view(torch.int16), values[:501].view(torch.int16))
