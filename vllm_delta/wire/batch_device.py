"""The batched decode (`Decoder`): a batch of block-indexed params rebuilt from their streams in a fixed
number of torch ops, on the host or on the params' device (the streams cross as 1-3 B a change, not int64
positions). Its checks fold into one flag a batch: raised at once on the host, kept for `verify` on a
device (no sync a batch), positions clamped in range until then."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from .batch_host import Fallback, HostBatch
from .encodings import Encoding, UlpSteps
from .errors import BoundsError


class Decoder:
    """The back end, chosen by the caller, never by the data: the params in `devices` decode there (call
    `verify` before using any of them), the others on the host, a failed check raised as `Fallback`."""

    def __init__(self, devices: Mapping[str, torch.device] | None = None) -> None:
        self.devices = dict(devices or {})
        found = set(self.devices.values())
        if len(found) > 1:  # a worker's tensors are on its one device
            raise ValueError(f"a Decoder decodes on one device, not on {sorted(map(str, found))}")
        self.device = next(iter(found), None)
        self.decoded: set[str] = set()  # the params a device decoded (the rest fell back to the host)
        self.checks: list[tuple[str, torch.Tensor, int]] = []  # per batch: first param, ok flag, bytes sent

    @property
    def uploaded(self) -> int:
        """Bytes the decode copied host to device."""
        return sum(n for _, _, n in self.checks)

    def decode(
        self, batch: HostBatch, enc: Encoding, device: torch.device | None, itemsizes: set[int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """int64 positions and, per value width in `itemsizes`, the values as signed integers."""
        pos, values, ok, sent = _decode(batch, enc, device or _CPU)
        if device is None and not bool(ok):
            raise Fallback
        if device is not None and batch.rows.size:
            self.checks.append((batch.ix.names[int(batch.ix.pid[batch.rows[0]])], ok, sent))
        return pos, narrow(values, itemsizes)

    def verify(self) -> None:
        """Raise `BoundsError` naming a batch's first param if its device checks failed: one copy."""
        if not self.checks or self.device is None or self.device.type == "meta":  # meta holds no values
            return
        for (name, *_), good in zip(self.checks, torch.stack([f for _, f, _ in self.checks]).cpu().tolist()):
            if not good:
                raise BoundsError(
                    "positions or ULP flags disagree with the block index (checked on the device, for a "
                    "batch of params from this one)",
                    param=name,
                )


HOST = Decoder()  # no state on the host: `decoded` and `checks` are only filled for devices
_CPU = torch.device("cpu")


def _exclusive(a: np.ndarray) -> np.ndarray:
    return np.cumsum(a) - a


class _Upload:
    """Host columns (one per row, or fewer) and stream bytes, gathered first, then sent in two copies."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.columns: list[np.ndarray] = []
        self.parts: list[np.ndarray] = []

    def column(self, values: np.ndarray) -> int:
        col = np.zeros(self.rows, dtype=np.int64)
        col[: values.size] = values
        self.columns.append(col)
        return len(self.columns) - 1

    def stream(self, raw: np.ndarray) -> int:
        """`raw`'s index among the uploaded streams."""
        self.parts.append(raw)
        return len(self.parts) - 1

    def send(self, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        """The table and each stream on `device` (one copy each, the streams split by one op there)."""
        table = np.stack(self.columns)
        if -(1 << 31) <= int(table.min()) and int(table.max()) < 1 << 31:  # the usual case: half the bytes
            table = table.astype(np.int32)
        buf = torch.from_numpy(np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=np.uint8))
        sent = table.nbytes + buf.nbytes
        sent_table = torch.from_numpy(table).to(device, non_blocking=True).to(torch.int64)
        sizes = [p.size for p in self.parts]
        streams = list(buf.to(device, non_blocking=True).split(sizes)) if sizes else []
        return sent_table, streams, sent


@dataclass
class _Planes:
    """Where one multi-byte field's bytes lie: per byte j its stream (None: no bytes) and the table column
    of each row's base; `width` the column of each row's byte count; `every[j]`: every row has byte j;
    `whole`: words stored whole (one base column), not in planes."""

    spans: list[int | None]
    bases: list[int]
    width: int
    every: list[bool]
    whole: bool = False


class _Device:
    """The uploaded table and bytes, and the per-entry row ids every field's gathers share."""

    def __init__(
        self, table: torch.Tensor, streams: list[torch.Tensor], cnt_col: int, estart_col: int, entries: int
    ) -> None:
        self.table, self.streams, self.n = table, streams, entries
        dev = table.device
        self.row_of = torch.repeat_interleave(
            torch.arange(table.shape[1], device=dev), table[cnt_col], output_size=entries
        )
        self.estart = table[estart_col]
        self.local = torch.arange(entries, device=dev) - self.per_entry(estart_col)

    def per_entry(self, col: int) -> torch.Tensor:
        return self.table[col].index_select(0, self.row_of)

    def field(
        self, planes: _Planes, local: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """int64 words from `planes`; `local` each entry's index in its row's share (default: its
        place in the row); `mask` (0/1) the entries that have a word at all (default: every one)."""
        out = torch.zeros(self.n, dtype=torch.int64, device=self.table.device)
        natural = local is None
        local = self.local if local is None else local
        width = None if all(planes.every) and not planes.whole else self.per_entry(planes.width)
        for j, span in enumerate(planes.spans):
            if span is None:
                continue
            src = self.streams[span]
            if planes.whole:
                assert width is not None  # read whenever words are whole
                at = self.per_entry(planes.bases[0]) + local * width + j
            elif planes.every[j] and natural and src.numel() == self.n:
                at = None  # every entry has this byte, in entry order: no gather
            else:
                at = self.per_entry(planes.bases[j]) + local
            byte = (src if at is None else src.index_select(0, at.clamp(0, src.numel() - 1))).to(torch.int64)
            if planes.every[j]:
                keep = mask
            else:
                assert width is not None  # read whenever some entry lacks a byte
                keep = (width > j) if mask is None else mask * (width > j)
            if keep is not None:
                byte = byte * keep
            out |= byte << (8 * j)
        return out


def _whole_words(up: _Upload, raw: np.ndarray, width: np.ndarray, cnt: np.ndarray) -> _Planes:
    """A stream of whole little-endian words, `width[row]` bytes each."""
    top = int(width.max())
    span = up.stream(raw) if raw.size else None
    return _Planes(
        [span] * top,
        [up.column(_exclusive(cnt * width))],
        up.column(width),
        [bool((width > j).all()) for j in range(top)],
        whole=True,
    )


def _byte_planes(batch: HostBatch, up: _Upload, prefix: str, width: np.ndarray, sizes: np.ndarray) -> _Planes:
    """Planes `prefix0..`: plane j holds the entries of the rows whose width > j (`sizes[row]` of them)."""
    top = int(width.max())
    streams = [batch.stream(f"{prefix}{j}", sizes) for j in range(top)]
    return _Planes(
        [up.stream(s) if s.size else None for s in streams],
        [up.column(_exclusive(np.where(width > j, sizes, 0))) for j in range(top)],
        up.column(width),
        [bool((width > j).all()) for j in range(top)],
    )


def _decode(
    batch: HostBatch, enc: Encoding, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """int64 positions and int64 value payloads (bit patterns, or wrapping ULP steps) of `batch`'s
    entries on `device`, the flag of their checks and the bytes sent; `Fallback` (from the host's size
    checks) before anything is sent."""
    ix, rows, cnt, n = batch.ix, batch.rows, batch.cnt, batch.entries
    if not n:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return empty, empty, torch.ones((), dtype=torch.bool, device=device), 0
    pid = ix.pid[rows]
    width, isz, numel = ix.width[pid], ix.itemsize[pid], ix.numel[pid]
    heads, prev = batch.heads
    up = _Upload(rows.size)
    c_cnt, c_estart = up.column(cnt), up.column(batch.estart)
    c_numel, c_first, c_last = up.column(numel), up.column(ix.first[rows]), up.column(ix.last[rows])
    c_run, c_hstart, c_prev = (
        up.column(np.cumsum(batch.run_start) - 1),
        up.column(batch.estart[heads]),
        up.column(prev),
    )
    if enc.positions.planes:
        gaps = _byte_planes(batch, up, "pos", width, cnt)
    else:
        gaps = _whole_words(up, batch.stream("positions", cnt * width), width, cnt)
    ulp = isinstance(enc.values, UlpSteps)
    if not enc.values.planes:
        vals = _whole_words(up, batch.stream("values", cnt * isz), isz, cnt)
    elif not ulp:
        vals = _byte_planes(batch, up, "val", isz, cnt)
    else:
        nbytes = (cnt + 7) // 8
        sign, flag = up.stream(batch.stream("sign", nbytes)), up.stream(batch.stream("flag", nbytes))
        c_bits = up.column(_exclusive(nbytes))
        claimed = ix.decoded[rows, ix.columns["esc0"]]  # every row lists esc0 (batch.parse checked the lists)
        c_claimed = up.column(claimed)
        vals = _byte_planes(batch, up, "esc", isz, claimed)  # the flags' counts are checked on the device
    table, streams, sent = up.send(device)
    d = _Device(table, streams, c_cnt, c_estart, n)
    row_of = d.row_of
    last_e = d.estart + table[c_cnt] - 1
    g = d.field(gaps)
    numel_e = d.per_entry(c_numel)
    checks = [((g >= 0) & (g < numel_e)).all()]
    cs = torch.cumsum(g + 1, 0)
    hstart = table[c_hstart]  # (rows past the heads: zero, never indexed by a run id)
    before = torch.where(hstart > 0, cs.index_select(0, (hstart - 1).clamp(min=0)), 0)
    pos = cs + (table[c_prev] - before).index_select(0, table[c_run]).index_select(0, row_of)
    checks += [
        ((pos >= 0) & (pos < numel_e)).all(),
        (pos.index_select(0, d.estart) == table[c_first]).all(),
        (pos.index_select(0, last_e) == table[c_last]).all(),
    ]
    pos = torch.minimum(pos.clamp(min=0), numel_e - 1)  # in range whatever the bytes said (checked above)
    if not ulp:
        values = d.field(vals)
    else:
        neg, big = (_bit(d, d.streams[s], c_bits) for s in (sign, flag))
        incl = torch.cumsum(big, 0)
        excl = incl - big
        at_start = excl.index_select(0, d.estart)
        checks.append((incl.index_select(0, last_e) - at_start == table[c_claimed]).all())
        esc = d.field(vals, excl - at_start.index_select(0, row_of), big)
        mag = torch.where(big.bool(), esc + 2, 1)
        values = torch.where(neg.bool(), -mag, mag)  # wraps as the host's uint64 0 - mag
    return pos, values, torch.stack(checks).all(), sent


def _bit(d: _Device, src: torch.Tensor, base_col: int) -> torch.Tensor:
    """Each entry's bit of a packed stream (np.packbits order: a row's bytes hold its entries' bits)."""
    at = d.per_entry(base_col) + (d.local >> 3)
    byte = src.index_select(0, at.clamp(0, max(src.numel() - 1, 0))).to(torch.int64)
    return (byte >> (7 - (d.local & 7))) & 1


def narrow(values: torch.Tensor, itemsizes: Iterable[int]) -> dict[int, torch.Tensor]:
    """int64 payloads as the signed integers of each width (their low bytes, as numpy's astype wraps)."""
    return {
        i: values
        if i == 8
        else values.view(getattr(torch, f"int{8 * i}")).reshape(-1, 8 // i).select(1, 0).contiguous()
        for i in itemsizes
    }
