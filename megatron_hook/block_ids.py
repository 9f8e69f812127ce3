"""Id tensors held one id per block of last-dim elements, for probing mbridge's conversion: one int64 id
per element would be O(elements). mbridge's rules only cat, chunk, split, slice, view and reshape whole
rows or column blocks, so each op runs on the blocks' first ids (refined first where it cuts finer); an op
it does not know raises, naming itself: never guessed."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

_CAT = {torch.cat, torch.concat, torch.concatenate}


class BlockIds:
    """The int64 tensor `ids` with `ids[..., j] == starts[..., j // width] + j % width`."""

    __slots__ = ("starts", "width")

    def __init__(self, starts: torch.Tensor, width: int) -> None:
        self.starts, self.width = starts, int(width)

    @classmethod
    def arange(cls, first: int, shape: Sequence[int], width: int | None = None) -> BlockIds:
        """Ids `first + arange(prod(shape))` laid out as `shape`, in blocks of `width` (default: rows)."""
        shape = tuple(int(n) for n in shape)
        if not shape:
            raise NotImplementedError("BlockIds: a 0-d tensor")
        width = shape[-1] if width is None else width
        if width <= 0 or shape[-1] % width:
            raise ValueError(f"block width {width} does not divide the last dim of {list(shape)}")
        starts = torch.arange(math.prod(shape) // width, dtype=torch.int64) * width + first
        return cls(starts.view(*shape[:-1], shape[-1] // width), width)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.starts.shape[:-1], self.starts.shape[-1] * self.width))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.starts.dim()

    ndim = property(dim)

    def numel(self) -> int:
        return self.starts.numel() * self.width

    def __len__(self) -> int:
        return self.shape[0]

    def contiguous(self) -> BlockIds:
        return self

    detach = clone = contiguous

    def refine(self, width: int) -> BlockIds:
        """The same ids in blocks of `width` (a divisor of the current width)."""
        if width == self.width:
            return self
        if width <= 0 or self.width % width:
            raise ValueError(f"cannot refine blocks of {self.width} into blocks of {width}")
        parts = torch.arange(0, self.width, width, dtype=torch.int64)
        starts = (self.starts.unsqueeze(-1) + parts).reshape(*self.starts.shape[:-1], -1)
        return BlockIds(starts, width)

    def reshape(self, *shape) -> BlockIds:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        shape = _infer(tuple(int(n) for n in shape), self.numel())
        if not shape:
            raise NotImplementedError("BlockIds: a 0-d result")
        blocks = self.refine(math.gcd(self.width, shape[-1]))
        return BlockIds(blocks.starts.reshape(*shape[:-1], shape[-1] // blocks.width), blocks.width)

    view = reshape

    def __getitem__(self, index) -> BlockIds:
        index = _expand_index(index if isinstance(index, tuple) else (index,), self.dim())
        last = index[-1]
        if isinstance(last, slice):
            start, stop, step = last.indices(self.shape[-1])
            if step != 1:
                blocks, last = self.refine(1), last
            else:
                stop = max(stop, start)
                blocks = self.refine(math.gcd(self.width, start, stop))
                last = slice(start // blocks.width, stop // blocks.width)
        elif isinstance(last, int):
            blocks = self.refine(1)  # an int on the last dim drops it: 1-wide blocks, one per element
        else:
            raise NotImplementedError(f"BlockIds: index {last!r} on the last dim")
        out = blocks.starts[(*index[:-1], last)]
        if out.dim() == 0:
            raise NotImplementedError("BlockIds: a 0-d result")
        return BlockIds(out, blocks.width)

    def split(self, split_size, dim: int = 0) -> tuple[BlockIds, ...]:
        dim = _dim(dim, self.dim())
        n = self.shape[dim]
        if isinstance(split_size, (list, tuple)):
            sizes = list(split_size)
        else:
            sizes = [min(split_size, n - a) for a in range(0, n, split_size)] if split_size else [n]
        if sum(sizes) != n:
            raise ValueError(f"split sizes {sizes} do not add up to {n}")
        if dim != self.dim() - 1:
            return tuple(BlockIds(s, self.width) for s in self.starts.split(sizes, dim))
        blocks = self.refine(math.gcd(self.width, *sizes))
        return tuple(
            BlockIds(s, blocks.width) for s in blocks.starts.split([k // blocks.width for k in sizes], dim)
        )

    def chunk(self, chunks: int, dim: int = 0) -> tuple[BlockIds, ...]:
        n = self.shape[_dim(dim, self.dim())]
        return self.split(max(1, -(-n // chunks)), dim)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _CAT:
            raise NotImplementedError(
                f"BlockIds: mbridge called {getattr(func, '__name__', func)}, which the "
                "block probe does not model"
            )
        return cat(list(args[0]), kwargs.get("dim", args[1] if len(args) > 1 else 0))


def cat(parts: Sequence[BlockIds], dim: int = 0) -> BlockIds:
    """`torch.cat` of id tensors, in blocks of the widths' common divisor."""
    if not all(isinstance(p, BlockIds) for p in parts):
        raise NotImplementedError("BlockIds: cat of block ids with plain tensors")
    width = math.gcd(*(p.width for p in parts))  # divides every part's last dim, so their sum too
    return BlockIds(torch.cat([p.refine(width).starts for p in parts], _dim(dim, parts[0].dim())), width)


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _infer(shape: tuple[int, ...], numel: int) -> tuple[int, ...]:
    if shape.count(-1) == 1:
        known = math.prod(n for n in shape if n != -1)
        shape = tuple(numel // known if n == -1 else n for n in shape)
    if math.prod(shape) != numel:
        raise RuntimeError(f"shape {list(shape)} is invalid for {numel} ids")
    return shape


def _expand_index(index: tuple, ndim: int) -> tuple:
    """A full-length index tuple of slices and ints (Ellipsis expanded); nothing else is modelled."""
    if any(i is None or isinstance(i, (torch.Tensor, list, bool)) for i in index):
        raise NotImplementedError(f"BlockIds: advanced index {index!r}")
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (ndim - len(index) + 1) + index[k + 1 :]
    if len(index) > ndim:
        raise IndexError(f"too many indices for {ndim} dims")
    return index + (slice(None),) * (ndim - len(index))
