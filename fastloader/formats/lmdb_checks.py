"""What LMDB trusts, checked before LMDB is let near a file.

See NOTE [ LMDB values checked against the file ] in lmdb.py.

LMDB reads its two meta pages, picks the one with the higher transaction id, and from then on
follows page numbers and sizes without checking them against the file. Here the meta pages are
read with plain file reads and everything LMDB will rely on is checked against the file's size.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from fastloader.formats.records import PackError

# The layout of an LMDB meta page on a 64-bit build (lmdb.h / mdb.c, data version 1):
# a 16-byte page header (pgno u64, pad u16, flags u16, lower/upper u16 u16), then MDB_meta:
# magic u32, version u32, address u64, mapsize u64, two MDB_db (pad u32 (the page size, in the
# free DB's), flags u16, depth u16, branch, leaf, overflow pages, entries, root: u64 each),
# last page u64, transaction id u64.
_PAGE_HEADER = struct.Struct("<QHHHH")
_META = struct.Struct("<IIQQ" + "IHHQQQQQ" * 2 + "QQ")
_P_META = 0x08
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_PAGE_SIZES = (4096, 8192, 16384, 32768, 65536)
_P_INVALID = (1 << 64) - 1
_MAX_DEPTH = 32  # a B-tree of 2^64 entries with two per page is 64 deep; ours are < 10


def _meta(path: Path, page: bytes) -> dict:
    if len(page) < _PAGE_HEADER.size + _META.size:
        raise PackError(f"{path}: not an LMDB file (too short for its meta pages)")
    _, _, flags, _, _ = _PAGE_HEADER.unpack_from(page)
    fields = _META.unpack_from(page, _PAGE_HEADER.size)
    magic, version = fields[0], fields[1]
    if not flags & _P_META or magic != _MAGIC:
        raise PackError(f"{path}: not an LMDB file (no LMDB meta page)")
    if version != _DATA_VERSION:
        raise PackError(f"{path}: damaged LMDB file (meta page data version {version})")
    free, main = fields[4:12], fields[12:20]
    return {
        "psize": free[0],
        "free": {"flags": free[1], "depth": free[2], "pages": sum(free[3:6]), "root": free[7]},
        "main": {"flags": main[1], "depth": main[2], "pages": sum(main[3:6]), "root": main[7]},
        "counts": dict(zip(("branch", "leaf", "overflow", "entries"), main[3:7], strict=True)),
        "last_pg": fields[20],
        "txnid": fields[21],
    }


def check_lmdb_file(path: Path, size: int) -> tuple[int, int]:
    """Check the meta pages of the LMDB file at ``path`` (``size`` bytes) against its size.

    Returns:
        (page size, root page of the main database) of the meta page LMDB will use.

    Raises:
        PackError: naming the file, if it is not LMDB, or its meta page points outside it.
    """
    meta = checked_meta(path, size)
    if meta["main"]["flags"] != 0:
        raise PackError(f"{path}: not a fastloader LMDB pack (database flags)")
    return meta["psize"], meta["main"]["root"]


def checked_meta(path: Path, size: int, *, whole: bool = True) -> dict:
    """The meta page LMDB will use for the file at ``path`` (``size`` bytes), checked against
    its size: ``psize``, ``last_pg``, ``main``/``free`` (flags, depth, pages, root) and the main
    database's page ``counts`` and entries. Raises PackError as ``check_lmdb_file``.

    ``whole=False`` accepts a file shorter than the pages the meta page says are in use (LMDB
    leaves the pages allocated and freed within one transaction unwritten at the end of a
    user's environment); then no page past the file's end may be referenced, which the caller
    checks."""
    with open(path, "rb") as file:
        first = file.read(_PAGE_HEADER.size + _META.size)
        meta0 = _meta(path, first)
        psize = meta0["psize"]
        if psize not in _PAGE_SIZES:
            raise PackError(f"{path}: damaged LMDB file (page size {psize})")
        file.seek(psize)
        meta1 = _meta(path, file.read(_PAGE_HEADER.size + _META.size))
    meta = meta1 if meta1["txnid"] > meta0["txnid"] else meta0  # what LMDB picks
    pages = meta["last_pg"] + 1
    if meta["last_pg"] >= _P_INVALID // psize or whole and pages * psize > size:
        raise PackError(
            f"{path}: truncated or damaged LMDB file (its meta page says {pages} pages of "
            f"{psize} bytes; the file has {size} bytes)"
        )
    for name in ("main", "free"):
        db = meta[name]
        empty = db["root"] == _P_INVALID
        if not empty and not 2 <= db["root"] < pages:
            raise PackError(f"{path}: damaged LMDB file ({name} root page {db['root']})")
        if db["depth"] > _MAX_DEPTH or db["pages"] > pages or (empty and db["depth"]):
            raise PackError(f"{path}: damaged LMDB file ({name} database statistics)")
    return meta


# The B-tree pages a value lookup walks (64-bit build): the 16-byte page header above, then
# u16 offsets of the page's nodes; a node is lo u16, hi u16, flags u16, key size u16, the key,
# then the data. A branch node's child page is lo | hi << 16 | flags << 32 (its first key is
# empty: everything below the second key); a leaf node's data size is lo | hi << 16, and with
# F_BIGDATA its data is the u64 number of the overflow page whose body holds the value.
_NODE = struct.Struct("<HHHH")
_PGNO = struct.Struct("<Q")
_P_BRANCH, _P_LEAF = 0x01, 0x02
_F_BIGDATA = 0x01
_HEADER = 16


def value_lies_in_file(file: bytes | memoryview, psize: int, root: int, key: bytes) -> bool | None:
    """Whether the value under ``key`` lies inside ``file`` (the whole LMDB file): the B-tree
    walked from ``root`` as LMDB will, every page number, node offset and size checked against
    the file, so LMDB (and py-lmdb, which reads a value's pages before returning it) is only
    asked for a value inside it (NOTE [ LMDB values checked against the file ] in lmdb.py).
    True if so, False if the way points outside the file or page, None if no ``key``."""
    span = value_span(file, psize, root, key)
    return span if span is None or span is False else True


def value_span(
    file: bytes | memoryview, psize: int, root: int, key: bytes
) -> tuple[int, int] | bool | None:
    """(offset, size) in ``file`` of the value under ``key``, walked as ``value_lies_in_file``
    says: False if the way points outside the file or page, None if ``key`` is not there."""
    found = _find_in_leaf(file, psize, root, key)
    if found is None or found is False:
        return found
    span = _value_span(found.page, found.node)
    return False if span is None else span


# A RecordSpans entry is one u64: 0 = not seen yet, _OUTSIDE = its node points outside the
# file, else size << _OFFSET_BITS | (offset + 1). A record too large or too far into the file
# for that (16 MiB, 1 TiB) stays 0 and is walked on every read.
_OFFSET_BITS = 40
_MAX_SIZE = (1 << (64 - _OFFSET_BITS)) - 2
_MAX_OFFSET = (1 << _OFFSET_BITS) - 2
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
_OUTSIDE = (1 << 64) - 1


class RecordSpans:
    """Where each record's value lies in the file, from leaves parsed and checked once.

    NOTE [ Record spans ]: a record read used to walk the B-tree (a few binary searches in
    Python) and then ask py-lmdb for the value: about 7 us of a 12-25 us raw record. Here the
    first lookup that reaches a leaf checks every node in it against the file (page, node
    offset, key, size, overflow page: what ``value_lies_in_file`` checks) and records the
    (offset, size) of each record key found, so later reads of any record of that leaf are an
    array lookup and a slice of fastloader's own read-only map of the file. Record keys are
    the big-endian u64 indices LMDBWriter writes, 0..n-1 in order, so a leaf's record keys are
    consecutive: a leaf where they skip or repeat has a damaged key, under which LMDB itself
    would return another record (whose checksum is right: it covers the record, not its key),
    and reading any record that lands in it raises. Only keys inside the range the branch keys
    above give the leaf are cached, and only under branches whose keys increase; other records
    are walked on each read, as LMDB would. 8 bytes per record, in
    zeroed memory that takes room only as leaves are read.
    """

    def __init__(self, file: bytes | memoryview, psize: int, root: int, count: int) -> None:
        self._file, self._psize, self._root = file, psize, root
        self._spans = np.zeros(count, dtype=np.uint64)
        self._parsed: set[int] = set()  # leaf pages already cached
        self._sorted_branches: dict[int, bool] = {}
        self._out_of_sequence: set[int] = set()  # leaf pages whose record keys skip or repeat
        # Called with the child page numbers of each branch page the first time it is walked
        # (read advice asks for them at once: NOTE [ Read advice for packs bigger than memory ]).
        self.prefetch: Callable[[list[int]], None] | None = None
        self._branches_seen: set[int] = set()

    def span(self, index: int) -> tuple[int, int] | bool | None:
        """(offset, size) of record ``index`` (stored under ``record_key(index)``) in the file.

        Returns False if its node or value points outside the file, None if it is missing.

        Raises:
            LeafDamaged: if the record keys of its leaf are out of sequence.
        """
        entry = int(self._spans[index])
        if entry == _OUTSIDE:
            return False
        if entry:
            return (entry & _OFFSET_MASK) - 1, entry >> _OFFSET_BITS
        on_branch = self._on_branch if self.prefetch is not None else None
        found = _find_in_leaf(self._file, self._psize, self._root, record_key(index), on_branch)
        if found is None or found is False:
            return found
        base = found.page[1]
        if base not in self._parsed:
            self._parsed.add(base)
            self._parse_leaf(found)
        if base in self._out_of_sequence:
            raise LeafDamaged(
                f"the record keys of its leaf page {base // self._psize} are out of sequence"
            )
        span = _value_span(found.page, found.node)
        return False if span is None else span

    def _on_branch(self, page: tuple) -> None:
        if page[1] in self._branches_seen or self.prefetch is None:
            return
        self._branches_seen.add(page[1])
        pages = len(self._file) // self._psize
        children = []
        for i in range(len(page[2])):
            try:
                _, lo, hi, flags, _ = _node(page, i)
            except ValueError:
                continue
            child = lo | hi << 16 | flags << 32
            if child < pages:
                children.append(child)
        self.prefetch(children)

    def _parse_leaf(self, found: _Found) -> None:
        # Once per leaf page: see NOTE [ Record spans ] and NOTE [ Leaves parsed with NumPy ].
        table = _record_leaf(found.page)
        if table is not None:
            keys, starts, sizes = table
            if len(keys) > 1 and not np.all(np.diff(keys) == 1):
                self._out_of_sequence.add(found.page[1])
            elif all(self._sorted(branch) for branch in found.branches):
                self._cache_table(found, keys, starts, sizes)
            return
        keys = _keys(found.page)
        if keys is not None and not _in_sequence(keys):
            self._out_of_sequence.add(found.page[1])
        elif keys is not None and all(self._sorted(branch) for branch in found.branches):
            self._cache_leaf(found, keys)

    def _cache_table(
        self, found: _Found, keys: np.ndarray, starts: np.ndarray, sizes: np.ndarray
    ) -> None:
        # What _cache_leaf does, for a leaf of record keys only, with NumPy.
        low = _lowest_key_from(found.low)
        high = min(len(self._spans), _lowest_key_from(found.high) if found.high else 1 << 64)
        if low >= high:
            return
        keep = (keys >= np.uint64(low)) & (keys < np.uint64(high))
        if not keep.any():
            return
        index = keys[keep].astype(np.int64)
        starts, sizes = starts[keep], sizes[keep]
        fresh = self._spans[index] == 0  # nothing is overwritten
        outside = starts < 0
        fits = ~outside & (starts <= _MAX_OFFSET) & (sizes <= _MAX_SIZE)
        entries = np.zeros(len(index), dtype=np.uint64)
        entries[outside] = _OUTSIDE
        entries[fits] = sizes[fits].astype(np.uint64) << np.uint64(_OFFSET_BITS) | (
            starts[fits].astype(np.uint64) + np.uint64(1)
        )
        write = fresh & (outside | fits)
        self._spans[index[write]] = entries[write]

    def _sorted(self, branch: tuple) -> bool:
        # Whether a branch page's keys (after node 0's) strictly increase: only then does the
        # range [low, high) the walk derived hold exactly the keys LMDB's search sends there.
        if branch[1] not in self._sorted_branches:
            keys = _keys(branch)
            ordered = keys is not None and _increasing(keys[1:])
            self._sorted_branches[branch[1]] = ordered
        return self._sorted_branches[branch[1]]

    def _cache_leaf(self, found: _Found, keys: list[bytes]) -> None:
        # Only keys inside the leaf's range are cached: a key outside it (a damaged or crafted
        # leaf) is one that LMDB's search would never find here. Nothing is overwritten.
        page, low, high = found.page, found.low, found.high
        if not _increasing(keys):
            return
        records = len(self._spans)
        for i, key in enumerate(keys):
            if len(key) != _PGNO.size or low is not None and key < low:
                continue
            if high is not None and key >= high:
                continue
            (index,) = _RECORD_KEY.unpack(key)
            if index >= records or self._spans[index]:
                continue
            span = _value_span(page, i)
            if span is None:
                self._spans[index] = _OUTSIDE
            elif span[0] <= _MAX_OFFSET and span[1] <= _MAX_SIZE:
                self._spans[index] = span[1] << _OFFSET_BITS | (span[0] + 1)


# NOTE [ Leaves parsed with NumPy ]
# Parsing a leaf node by node in Python cost about 35 us per small record on a first pass over
# a pack of small in-leaf records (18.5k samples/s against 42.4k once every leaf was cached, in
# issue 23). A leaf whose nodes all hold 8-byte keys (every leaf of a pack but the one with its
# own longer keys) is parsed at once: node offsets, headers, keys and overflow page numbers are
# gathered as arrays and checked with the same rules as ``_node``, ``_value_span`` and
# ``_in_sequence``; any node that does not fit those rules (outside its page, another key size)
# sends the whole leaf down the node-by-node path, which decides as before.


def _record_leaf(page: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(keys as uint64, value offsets, value sizes) of a leaf of 8-byte keys; an offset of -1
    where the value lies outside the file. None if any node has another key size or lies
    outside the page: then it is parsed node by node. See NOTE [ Leaves parsed with NumPy ]."""
    file, base, offsets, lower, psize = page
    at = np.array(offsets, dtype=np.int64)
    if at.size == 0 or np.any(at < lower) or np.any(at + _NODE.size + _PGNO.size > psize):
        return None
    raw = np.frombuffer(file, np.uint8, psize, base)
    fields = raw[at[:, None] + np.arange(_NODE.size)].view("<u2")  # lo, hi, flags, key size
    if np.any(fields[:, 3] != _PGNO.size):
        return None
    key_at = at + _NODE.size
    keys = raw[key_at[:, None] + np.arange(8)].view(">u8")[:, 0].astype(np.uint64)
    sizes = fields[:, 0].astype(np.int64) | fields[:, 1].astype(np.int64) << 16
    data_at = key_at + _PGNO.size
    big = (fields[:, 2] & _F_BIGDATA) != 0
    starts = np.where(~big & (data_at + sizes <= psize), base + data_at, -1)
    pointer = big & (data_at + _PGNO.size <= psize)
    if pointer.any():
        where = data_at[pointer]
        overflow = raw[where[:, None] + np.arange(8)].view("<u8")[:, 0]
        pages = len(file) // psize
        inside = overflow < np.uint64(pages)
        start = np.where(inside, overflow.astype(np.int64) * psize + _HEADER, 0)  # no overflow
        inside &= start + sizes[pointer] <= len(file)
        starts[pointer] = np.where(inside, start, -1)
    return keys, starts, sizes


def _lowest_key_from(bound: bytes | None) -> int:
    """The smallest u64 whose 8-byte big-endian key is not below ``bound`` (bytes order), so
    that ``key >= bound`` reads ``number >= _lowest_key_from(bound)``; 2**64 if none is."""
    if bound is None:
        return 0
    if len(bound) <= 8:
        return int.from_bytes(bound.ljust(8, b"\0"), "big")
    return int.from_bytes(bound[:8], "big") + 1  # an 8-byte prefix sorts before the bound


class LeafDamaged(Exception):
    """A record's leaf page is damaged in a way that could return another record's bytes."""


def _in_sequence(keys: list[bytes]) -> bool:
    # LMDBWriter appends records under keys 0..n-1 (and the pack's own keys, longer, after
    # them), so the record keys of any leaf are consecutive. A damaged key breaks that run:
    # LMDB would then find another record's value under it (its checksum is that record's,
    # and right), so such a leaf's records are refused (NOTE [ Record spans ]).
    numbers = [int.from_bytes(key, "big") for key in keys if len(key) == _PGNO.size]
    return all(b == a + 1 for a, b in zip(numbers, numbers[1:], strict=False))


def _increasing(keys: list[bytes]) -> bool:
    return all(a < b for a, b in zip(keys, keys[1:], strict=False))


def _keys(page: tuple) -> list[bytes] | None:
    """Every node's key of a page, or None if a node lies outside it."""
    try:
        return [_key(page, i) for i in range((page[3] - _HEADER) // 2)]
    except ValueError:
        return None


_RECORD_KEY = struct.Struct(">Q")


def record_key(index: int) -> bytes:
    """The LMDB key of record ``index``: big-endian u64, so keys sort as the indices do."""
    return _RECORD_KEY.pack(index)


class _Found(NamedTuple):
    """Where a walk for a key ended: its leaf page and node, the key range the branches above
    give that leaf ([low, high); None: unbounded), and the branch pages walked through."""

    page: tuple
    node: int
    low: bytes | None
    high: bytes | None
    branches: list[tuple]


def _branch_child(page: tuple, count: int, key: bytes) -> int:
    """The last node of a branch page whose key is <= ``key`` (node 0 stands for -inf)."""
    low, high, chosen = 1, count - 1, 0
    while low <= high:
        middle = (low + high) // 2
        if _key(page, middle) <= key:
            chosen, low = middle, middle + 1
        else:
            high = middle - 1
    return chosen


def _leaf_node(page: tuple, count: int, key: bytes) -> int | None:
    """The node of a leaf page whose key is ``key``, or None."""
    low, high = 0, count - 1
    while low <= high:
        middle = (low + high) // 2
        found = _key(page, middle)
        if found == key:
            return middle
        if found < key:
            low = middle + 1
        else:
            high = middle - 1
    return None


def _find_in_leaf(
    file: bytes | memoryview,
    psize: int,
    root: int,
    key: bytes,
    on_branch: Callable[[tuple], None] | None = None,
) -> _Found | bool | None:
    """Walk to the leaf that holds ``key``: a ``_Found``, False if the walk leaves the file,
    None if ``key`` is not in the tree. ``on_branch(page)`` is called at each branch page."""
    if root == _P_INVALID:  # an empty database
        return None
    pages = len(file) // psize
    pgno = root
    bound_low: bytes | None = None
    bound_high: bytes | None = None
    branches: list[tuple] = []
    for _ in range(_MAX_DEPTH + 1):
        if pgno >= pages:
            return False
        base = pgno * psize
        _, _, flags, lower, upper = _PAGE_HEADER.unpack_from(file, base)
        count = (lower - _HEADER) // 2
        if lower < _HEADER or lower > psize or count <= 0 and flags & _P_BRANCH:
            return False
        offsets = struct.unpack_from(f"<{count}H", file, base + _HEADER)

        page = (file, base, offsets, lower, psize)
        try:
            if flags & _P_BRANCH:
                if on_branch is not None:
                    on_branch(page)
                chosen = _branch_child(page, count, key)
                _, lo, hi, node_flags, _ = _node(page, chosen)
                pgno = lo | hi << 16 | node_flags << 32
                if chosen > 0:  # node 0's key stands for everything below node 1's
                    bound_low = _key(page, chosen)
                if chosen + 1 < count:
                    bound_high = _key(page, chosen + 1)
                branches.append(page)
                continue
            if not flags & _P_LEAF:
                return False
            node = _leaf_node(page, count, key)
            return None if node is None else _Found(page, node, bound_low, bound_high, branches)
        except (ValueError, struct.error):
            return False
    return False


def _value_span(page: tuple, i: int) -> tuple[int, int] | None:
    """(offset in the file, size) of the value of leaf node ``i``; None if outside the file."""
    file, base, _, _, psize = page
    try:
        at, lo, hi, node_flags, ksize = _node(page, i)
    except ValueError:
        return None
    data_size, data_at = lo | hi << 16, at + _NODE.size + ksize
    if not node_flags & _F_BIGDATA:
        return (base + data_at, data_size) if data_at + data_size <= psize else None
    if data_at + _PGNO.size > psize:
        return None
    (overflow,) = _PGNO.unpack_from(file, base + data_at)
    start = overflow * psize + _HEADER
    if overflow >= len(file) // psize or start + data_size > len(file):
        return None
    return start, data_size


def _node(page: tuple, i: int) -> tuple[int, int, int, int, int]:
    """Node ``i`` of a page: (offset, lo, hi, flags, key size), checked to lie in the page."""
    file, base, offsets, lower, psize = page
    at = offsets[i]
    if at < lower or at + _NODE.size > psize:
        raise ValueError
    lo, hi, node_flags, ksize = _NODE.unpack_from(file, base + at)
    if at + _NODE.size + ksize > psize:
        raise ValueError
    return at, lo, hi, node_flags, ksize


def _key(page: tuple, i: int) -> bytes:
    at, _, _, _, ksize = _node(page, i)
    start = page[1] + at + _NODE.size
    return bytes(page[0][start : start + ksize])
