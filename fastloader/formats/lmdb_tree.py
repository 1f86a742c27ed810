"""The whole B-tree of a user's LMDB environment, checked in our own map before anything reads it.

NOTE [ Users' LMDB trees checked whole ]
py-lmdb (and LMDB under it) trusts every page number, node offset and page type it meets: a
branch node aimed at a meta page, an overflow page or its own page makes LMDB's cursor abort
the process (``Assertion 'IS_LEAF(mp)' failed in mdb_cursor_next()``), an overflow pointer
aimed at the meta page returns the meta page as a value, a flipped ``mp_lower`` silently drops
nodes. A pack's records carry checksums that catch what slips through (NOTE [ LMDB values
checked against the file ] in lmdb.py); a user's environment carries none. So a user's
environment is never walked by LMDB at all: ``check_tree`` walks the main database's tree once,
at construction, with plain reads of fastloader's own read-only map, and checks every page it
meets against what LMDB writes:

- every page number lies among the pages the meta page says are in use and is not a meta
  page (0, 1); each page header names its own number; branch and leaf pages are reached once
  (no cycles, no page shared by two parents, none aimed at itself) and all leaves lie at the
  depth the meta page gives;
- ``mp_lower``/``mp_upper`` are sane (16 <= lower <= upper <= page size) and the nodes tile the
  page from ``mp_upper`` to its end, as LMDB packs them: a damaged ``mp_lower`` or node offset
  cannot hide a node or point into another one;
- keys strictly increase within a page and lie inside the range the branch keys above give the
  page, so the order listed is the order LMDB's search and cursor agree on;
- an overflow value's page is an overflow page naming itself, holding enough pages for the
  value, inside the file; overflow pages and tree pages never overlap;
- the meta page's counts (branch, leaf, overflow pages, entries) equal what the walk found.

The walk yields every key and its value's (offset, size) in the file, kept as NumPy arrays;
reads are then slices of the same map (``lmdb_foreign.py``), with no walk and no LMDB call:
20-30x py-lmdb's reads of the same values in random batches (a 20 000-value environment on
the shared box). The price is paid once, at construction: about 9 us a key (1.7-2.4 s for
200 000 keys at load 8, against 0.2 s for py-lmdb's bare listing), in the main process only
(workers get the arrays). A NumPy version of the leaf checks measured no faster: the time
goes to reading each overflow page's header, which the check needs.

Rules for what a user's environment may hold: the main database's values are the samples.
Named sub-databases (``env.open_db(b"name")``) are entries of the main database whose value is
a database record, not a sample: they are skipped when keys are listed, and naming one in
``keys=`` is refused (their own trees are not read). A main database opened with other flags
(``dupsort``, ``integerkey``, ``reverse_key``...) is refused: its key order is not byte order.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fastloader.formats.lmdb_checks import _NODE, _PAGE_HEADER, _PGNO
from fastloader.formats.records import PackError

__all__ = ["Tree", "check_tree"]

_HEADER = _PAGE_HEADER.size  # 16: pgno u64, pad u16, flags u16, lower u16, upper u16
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META = 0x01, 0x02, 0x04, 0x08
_P_KINDS = _P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_META | 0x20 | 0x40  # + LEAF2, SUBP
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_DB = struct.Struct("<IHHQQQQQ")  # MDB_db: pad, flags, depth, page counts, entries, root
_DB_RECORD = _DB.size  # 48: the value of a named sub-database's entry
_DB_FLAGS = 0x7E  # what a named database may be opened with (reverse/dup/integer keys...)
_OVERFLOW_PAGES = struct.Struct("<I")  # mp_pages, where an overflow page has lower/upper
_P_INVALID = (1 << 64) - 1
_COUNTS = ("branch", "leaf", "overflow", "entries")


class Tree(NamedTuple):
    """Every sample of a checked main database, in key order."""

    keys: np.ndarray  # uint8: the keys back to back
    key_offsets: np.ndarray  # int64, len(keys) + 1: key i is keys[key_offsets[i]:[i + 1]]
    starts: np.ndarray  # int64: where value i starts in the file
    sizes: np.ndarray  # int64: its size
    subdatabases: frozenset[bytes]  # names of the named sub-databases (not samples)


def check_tree(file: bytes | memoryview, path: Path, meta: dict) -> Tree:
    """Walk and check the whole main-database tree of an LMDB file (NOTE [ Users' LMDB trees
    checked whole ]).

    Args:
        file: the whole file (fastloader's read-only map of it).
        path: how errors name it.
        meta: the meta page LMDB would use (``lmdb_checks.checked_meta``).

    Raises:
        PackError: naming the file and the first thing found wrong.
    """
    main = meta["main"]
    if main["flags"] != 0:
        raise PackError(
            f"{path}: an LMDB main database with flags {main['flags']:#x} (dupsort, integer or "
            f"reversed keys): not read, its order is not the keys' byte order"
        )
    walk = _Walk(file, path, meta["psize"], meta["last_pg"] + 1)
    if main["root"] != _P_INVALID:
        walk.subtree(main["root"], main["depth"], None, None)
    found = dict(zip(_COUNTS, walk.counts, strict=True))
    for name in _COUNTS:
        if found[name] != meta["counts"][name]:
            raise PackError(
                f"{walk.where} (the meta page counts {meta['counts'][name]} {name} "
                f"{'' if name == 'entries' else 'pages '}in the main database; its tree holds "
                f"{found[name]})"
            )
    walk.check_no_overlap()
    return walk.tree()


class _Walk:
    def __init__(self, file: bytes | memoryview, path: Path, psize: int, in_use: int) -> None:
        # pages past the file's end may be in use but unwritten: see checked_meta(whole=)
        self.file, self.psize, self.pages = file, psize, min(in_use, len(file) // psize)
        self.in_use, self.path = in_use, path
        self.where = f"{path}: damaged LMDB environment"
        self.seen: set[int] = set()
        self.counts = [0, 0, 0, 0]  # branch, leaf, overflow pages, entries
        self.overflows: list[tuple[int, int]] = []
        self.keys: list[bytes] = []
        self.starts: list[int] = []
        self.sizes: list[int] = []
        self.subdatabases: set[bytes] = set()

    def fail(self, pgno: int, what: str) -> PackError:
        return PackError(f"{self.where} (page {pgno}: {what})")

    # NOTE [ Users' LMDB trees checked whole ]: an explicit stack, children in key order.
    def subtree(self, root: int, depth: int, low: bytes | None, high: bytes | None) -> None:
        stack = [(root, depth, low, high)]
        while stack:
            pgno, levels, low, high = stack.pop()
            flags, offsets = self._page(pgno)
            if flags == _P_BRANCH:
                if levels <= 1:
                    raise self.fail(pgno, "a branch page where the tree's depth puts leaves")
                self.counts[0] += 1
                children = self._branch(pgno, offsets, low, high)
                stack.extend((child, levels - 1, lo, hi) for child, lo, hi in reversed(children))
            else:
                if levels != 1:
                    raise self.fail(pgno, "a leaf page above the tree's depth")
                self.counts[1] += 1
                self._leaf(pgno, offsets, low, high)

    def _page(self, pgno: int) -> tuple[int, tuple[int, ...]]:
        """A branch or leaf page's flags and node offsets, its header checked."""
        if self.pages <= pgno < self.in_use:
            raise PackError(
                f"{self.path}: truncated or damaged LMDB file (page {pgno} of its tree lies past "
                f"the end of the file, {len(self.file)} bytes)"
            )
        if not 2 <= pgno < self.pages:
            raise self.fail(pgno, f"outside the {self.pages} pages in use, or a meta page")
        if pgno in self.seen:
            raise self.fail(pgno, "reached twice (a cycle, or a page shared by two parents)")
        self.seen.add(pgno)
        base = pgno * self.psize
        number, _, flags, lower, upper = _PAGE_HEADER.unpack_from(self.file, base)
        kind = flags & _P_KINDS
        if number != pgno:
            raise self.fail(pgno, f"its header says page {number}")
        if kind not in (_P_BRANCH, _P_LEAF):
            raise self.fail(pgno, f"a tree pointer to a page of flags {flags:#x}")
        if not _HEADER + 2 <= lower <= upper <= self.psize or lower % 2:
            raise self.fail(pgno, f"mp_lower {lower}, mp_upper {upper}")
        offsets = struct.unpack_from(f"<{(lower - _HEADER) // 2}H", self.file, base + _HEADER)
        return kind, offsets

    def _nodes(self, pgno: int, offsets: tuple[int, ...], leaf: bool) -> list[tuple]:
        """(offset, lo, hi, flags, key) of each node, checked to tile the page from mp_upper."""
        base, psize = pgno * self.psize, self.psize
        upper = _PAGE_HEADER.unpack_from(self.file, base)[4]
        nodes, spans = [], []
        for at in offsets:
            if not upper <= at <= psize - _NODE.size:
                raise self.fail(pgno, f"a node at offset {at}, outside the page's nodes")
            lo, hi, flags, ksize = _NODE.unpack_from(self.file, base + at)
            size = _NODE.size + ksize
            if leaf:
                size += _PGNO.size if flags & _F_BIGDATA else lo | hi << 16
            spans.append((at, size + (size & 1)))
            if at + size > psize:
                raise self.fail(pgno, f"a node at offset {at} runs past the page")
            key_at = base + at + _NODE.size
            nodes.append((at, lo, hi, flags, bytes(self.file[key_at : key_at + ksize])))
        spans.sort()
        end = upper
        for at, size in spans:
            if at != end:
                raise self.fail(pgno, "its nodes do not tile the page (mp_lower or a node offset)")
            end = at + size
        if end != psize:
            raise self.fail(pgno, "its nodes do not tile the page (mp_lower or a node offset)")
        return nodes

    def _branch(
        self, pgno: int, offsets: tuple[int, ...], low: bytes | None, high: bytes | None
    ) -> list[tuple[int, bytes | None, bytes | None]]:
        nodes = self._nodes(pgno, offsets, leaf=False)
        keys = [node[4] for node in nodes[1:]]  # node 0's key stands for everything below
        _check_order(self, pgno, keys, low, high, strict_low=True)
        bounds = [low, *keys, high]
        return [
            (lo | hi << 16 | flags << 32, bounds[i], bounds[i + 1])
            for i, (_, lo, hi, flags, _) in enumerate(nodes)
        ]

    def _leaf(
        self, pgno: int, offsets: tuple[int, ...], low: bytes | None, high: bytes | None
    ) -> None:
        nodes = self._nodes(pgno, offsets, leaf=True)
        _check_order(self, pgno, [node[4] for node in nodes], low, high, strict_low=False)
        base = pgno * self.psize
        self.counts[3] += len(nodes)
        for at, lo, hi, flags, key in nodes:
            size, data_at = lo | hi << 16, base + at + _NODE.size + len(key)
            if not key:
                raise self.fail(pgno, "an empty key (LMDB stores none)")
            if flags == _F_SUBDATA and size == _DB_RECORD:
                self._check_subdatabase(pgno, data_at)
                self.subdatabases.add(key)
                continue
            if flags & ~_F_BIGDATA:  # F_DUPDATA, or a sub-database record of another size
                raise self.fail(pgno, f"node flags {flags:#x} in a database of unique keys")
            if flags & _F_BIGDATA:
                (overflow,) = _PGNO.unpack_from(self.file, data_at)
                data_at = self._overflow(pgno, overflow, size)
            self.keys.append(key)
            self.starts.append(data_at)
            self.sizes.append(size)

    def _check_subdatabase(self, pgno: int, at: int) -> None:
        """A sub-database's record is an MDB_db (its tree is not read): a sample whose node
        flags were damaged into F_SUBDATA must not vanish silently from the listing."""
        pad, flags, depth, branch, leaf, overflow, entries, root = _DB.unpack_from(self.file, at)
        empty = root == _P_INVALID
        sane = (
            pad < self.psize  # the key size of DUPFIXED records, else 0
            and not flags & ~_DB_FLAGS
            and depth <= 32
            and empty == (depth == 0) == (entries == 0) == (branch + leaf + overflow == 0)
            and (empty or 2 <= root < self.in_use and branch + leaf + overflow < self.in_use)
        )
        if not sane:
            raise self.fail(pgno, "a named sub-database's record is damaged")

    def _overflow(self, parent: int, pgno: int, size: int) -> int:
        """Where the value of ``size`` bytes on overflow page ``pgno`` starts, checked."""
        needed = (_HEADER + size + self.psize - 1) // self.psize
        if not 2 <= pgno < self.pages or pgno + needed > self.pages:
            raise self.fail(parent, f"an overflow value on page {pgno}, outside the file's pages")
        base = pgno * self.psize
        number, _, flags, _, _ = _PAGE_HEADER.unpack_from(self.file, base)
        (count,) = _OVERFLOW_PAGES.unpack_from(self.file, base + 12)
        if number != pgno or flags & _P_KINDS != _P_OVERFLOW:
            raise self.fail(parent, f"an overflow value on page {pgno}, not an overflow page")
        if not needed <= count <= self.pages - pgno:
            raise self.fail(pgno, f"an overflow page of {count} pages for {size} bytes")
        self.overflows.append((pgno, count))
        self.counts[2] += count
        return base + _HEADER

    def check_no_overlap(self) -> None:
        spans = sorted([(pgno, 1) for pgno in self.seen] + self.overflows)
        for (start, count), (following, _) in zip(spans, spans[1:], strict=False):
            if start + count > following:
                raise self.fail(following, "used twice (overflow values overlap the tree)")

    def tree(self) -> Tree:
        lengths = np.fromiter(map(len, self.keys), dtype=np.int64, count=len(self.keys))
        offsets = np.zeros(len(self.keys) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return Tree(
            np.frombuffer(b"".join(self.keys), dtype=np.uint8),
            offsets,
            np.asarray(self.starts, dtype=np.int64),
            np.asarray(self.sizes, dtype=np.int64),
            frozenset(self.subdatabases),
        )


def _check_order(
    walk: _Walk,
    pgno: int,
    keys: list[bytes],
    low: bytes | None,
    high: bytes | None,
    *,
    strict_low: bool,
) -> None:
    """Keys strictly increasing, inside [low, high) (a branch's separators above ``low``)."""
    if any(a >= b for a, b in zip(keys, keys[1:], strict=False)):
        raise walk.fail(pgno, "its keys are out of order")
    if not keys:
        return
    if low is not None and (keys[0] < low or strict_low and keys[0] == low):
        raise walk.fail(pgno, "a key below the range its parent gives the page")
    if high is not None and keys[-1] >= high:
        raise walk.fail(pgno, "a key above the range its parent gives the page")
