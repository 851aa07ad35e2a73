"""Rebuilding each tensor's bytes in an output file, straight from the shard files.

* A tensor whose output bytes are contiguous byte ranges of the shards (replicated:
  rank 0's piece; split along dim 0: the pieces one after another; replicated KV
  heads: the first copy of each run of heads) is copied file to file by the kernel
  (`os.copy_file_range`, else `os.sendfile`, else reads and writes through one
  buffer), never entering this process.
* A tensor split along a later dim interleaves its pieces row by row, as raw bytes
  (so any dtype, bf16 included), in blocks of at most `CHUNK_BYTES` assembled in a
  reused buffer: each piece's rows are read straight into place with one `preadv`
  (pieces with rows narrower than `SCATTER_MIN_BYTES` are read whole and interleaved
  with numpy).

Memory stays near two blocks of `CHUNK_BYTES`, whatever the model's size.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from meshtrain.checkpoint.consolidate.convert import Cast, caster
from meshtrain.checkpoint.consolidate.plan import Piece, TensorPlan, byte_ranges, kept_rows
from meshtrain.checkpoint.fileio import (
    pread_some,
    preadv_all,
    read_into,
    write_all,
)
from meshtrain.checkpoint.manifest import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from meshtrain.checkpoint.consolidate.progress import Bar

CHUNK_BYTES = 2**20  # the largest block of output rows interleaved at once (fits in L2)
COPY_BYTES = 64 * 2**20  # the most bytes one kernel copy call moves (between progress updates)
MAX_OPEN_SHARDS = 64  # shard files kept open at once (least recently used closed first)
SCATTER_MIN_BYTES = 256  # narrower piece rows are interleaved with numpy, not read in place

# errno values meaning "this way of copying does not work here", not "the copy failed".
_UNSUPPORTED = {
    errno.EXDEV,
    errno.ENOSYS,
    errno.EOPNOTSUPP,
    getattr(errno, "ENOTSUP", errno.EOPNOTSUPP),
    errno.EINVAL,
    errno.ENOTSOCK,
}


class _ByteCopier:
    """Copies byte ranges between files: `os.copy_file_range` (in the kernel, no copy
    through this process), else `os.sendfile`, else reads and writes through one
    buffer. A way that fails as unsupported is not tried again by this copier."""

    def __init__(self) -> None:
        kernel = [way for way in ("copy_file_range", "sendfile") if hasattr(os, way)]
        self.ways = [*kernel, "read_write"]  # the first is the one in use
        self._buffer: bytearray | None = None

    def copy(
        self, src: int, src_offset: int, dst: int, dst_offset: int, count: int, bar: Bar
    ) -> None:
        while count > 0:
            step = min(count, COPY_BYTES)
            done = self._copy_some(src, src_offset, dst, dst_offset, step)
            if done == 0:
                # Some file systems answer 0 to copy_file_range/sendfile instead of an error.
                if len(self.ways) == 1:
                    raise CheckpointError("a shard file ended before the data its header lists")
                self.ways.pop(0)
                continue
            src_offset += done
            dst_offset += done
            count -= done
            bar.update(done)

    def _copy_some(self, src: int, src_offset: int, dst: int, dst_offset: int, count: int) -> int:
        while True:
            way = self.ways[0]
            try:
                if way == "copy_file_range":
                    return os.copy_file_range(src, dst, count, src_offset, dst_offset)
                if way == "sendfile":
                    os.lseek(dst, dst_offset, os.SEEK_SET)
                    return os.sendfile(dst, src, src_offset, count)
            except OSError as error:
                if error.errno not in _UNSUPPORTED:
                    raise
                self.ways.pop(0)
                continue
            if self._buffer is None:
                self._buffer = bytearray(max(1, min(COPY_BYTES, CHUNK_BYTES)))
            view = memoryview(self._buffer)[:count]
            got = pread_some(src, view, src_offset)
            write_all(dst, view[:got], dst_offset)
            return got


class _ShardFiles:
    """Read-only descriptors of the shard files, opened on first use; past
    `MAX_OPEN_SHARDS` open, the least recently used are closed (never one of the
    files asked for at the same time)."""

    def __init__(self) -> None:
        self._open: OrderedDict[Path, int] = OrderedDict()

    def fds(self, paths: Sequence[Path]) -> list[int]:
        """A descriptor of each of `paths`, all open together."""
        fds = []
        for path in paths:
            fd = self._open.get(path)
            if fd is not None:
                self._open.move_to_end(path)
            else:
                for old in [p for p in self._open if p not in paths]:  # oldest first
                    if len(self._open) < MAX_OPEN_SHARDS:
                        break
                    os.close(self._open.pop(old))
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
                if hasattr(os, "posix_fadvise"):
                    with contextlib.suppress(OSError):  # advice only
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self._open[path] = fd
            fds.append(fd)
        return fds

    def close(self) -> None:
        while self._open:
            os.close(self._open.popitem()[1])


class _Scratch:
    """Two byte buffers reused for every interleaved block: the output block, and one
    piece's part of it (blocks allocated and freed one by one would leave the C
    allocator holding on to freed memory)."""

    def __init__(self) -> None:
        self._buffers = [bytearray(), bytearray()]

    def get(self, which: int, nbytes: int) -> memoryview:
        if nbytes > len(self._buffers[which]):
            self._buffers[which] = bytearray()  # free the old one first
            self._buffers[which] = bytearray(nbytes)
        return memoryview(self._buffers[which])[:nbytes]


def _interleave(
    plan: TensorPlan,
    shards: _ShardFiles,
    scratch: _Scratch,
    fd: int,
    offset: int,
    bar: Bar,
    cast: Cast | None = None,
) -> None:
    """Write a tensor split along dim d >= 1 at `offset` of `fd`.

    As bytes, each piece is a matrix with one row per index of dims < d; an output
    row is the pieces' rows side by side. Blocks of output rows of at most about
    CHUNK_BYTES are assembled in `scratch` and written. Each piece's part of a block
    is read straight into place, one `preadv` segment per row; pieces whose rows are
    narrower than `SCATTER_MIN_BYTES` (too many segments) are read whole and
    interleaved with numpy instead. `cast` converts each block's bytes to the output
    dtype before it is written."""
    dim = plan.tp_dim
    shape = plan.pieces[0].shape
    widths = [math.prod(piece.shape[dim:]) * plan.spec.itemsize for piece in plan.pieces]
    width = sum(widths)
    per_row = math.prod(shape[1:dim])  # matrix rows per dim-0 index
    if width == 0 or per_row == 0:
        return
    scatter = min(w for w in widths if w) >= SCATTER_MIN_BYTES and hasattr(os, "preadv")
    if not scatter:
        import numpy
    fds = shards.fds([piece.path for piece in plan.pieces])
    step = max(1, CHUNK_BYTES // width)
    for begin, end in kept_rows(plan, shape[0]):
        for low in range(begin * per_row, end * per_row, step):
            count = min(step, end * per_row - low)
            block = scratch.get(0, count * width)
            matrix = None if scatter else numpy.frombuffer(block, numpy.uint8).reshape(count, -1)
            column = 0
            for piece, piece_fd, piece_width in zip(plan.pieces, fds, widths, strict=True):
                start = piece.start + low * piece_width
                if piece_width and scatter:
                    rows = range(column, count * width, width)
                    views = [block[row : row + piece_width] for row in rows]
                    preadv_all(piece_fd, views, start, piece.path)
                elif piece_width:
                    part = scratch.get(1, count * piece_width)
                    read_into(piece_fd, part, start, piece.path)
                    part_matrix = numpy.frombuffer(part, numpy.uint8).reshape(count, -1)
                    matrix[:, column : column + piece_width] = part_matrix
                column += piece_width
            data = block if cast is None else cast(block)
            write_all(fd, data, offset)
            offset += len(data)
            bar.update(count * width)


class TensorWriter:
    """Writes whole tensors from the shards into output files, keeping what is reused
    from tensor to tensor: the open shard files, the copier and the scratch buffers."""

    def __init__(self) -> None:
        self._shards = _ShardFiles()
        self._copier = _ByteCopier()
        self._scratch = _Scratch()

    def write(self, plan: TensorPlan, fd: int, offset: int, bar: Bar) -> None:
        """Write the tensor's bytes at `offset` of `fd` (cast to `plan.written`'s dtype)."""
        cast = caster(plan.spec.dtype_name, plan.written.dtype_name)
        if plan.tp_dim not in (None, 0):
            _interleave(plan, self._shards, self._scratch, fd, offset, bar, cast)
            return
        for piece, start, length in byte_ranges(plan):
            (source,) = self._shards.fds([piece.path])
            if cast is None:
                self._copier.copy(source, piece.start + start, fd, offset, length, bar)
                offset += length
            else:
                offset = self._cast_range(source, piece, start, length, fd, offset, cast, bar)

    def _cast_range(
        self,
        source: int,
        piece: Piece,
        start: int,
        length: int,
        fd: int,
        offset: int,
        cast: Cast,
        bar: Bar,
    ) -> int:
        """Read `length` bytes of a piece in element-aligned blocks, cast, write at `offset`;
        returns the offset after them."""
        step = CHUNK_BYTES - CHUNK_BYTES % 8
        for low in range(0, length, step):
            count = min(step, length - low)
            block = self._scratch.get(0, count)
            read_into(source, block, piece.start + start + low, piece.path)
            data = cast(block)
            write_all(fd, data, offset)
            offset += len(data)
            bar.update(count)
        return offset

    def close(self) -> None:
        self._shards.close()
