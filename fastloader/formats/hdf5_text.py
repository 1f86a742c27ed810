"""Strings of a user's HDF5 file, decoded as h5py's ``asstr()`` decodes them.

NOTE [ Strings decoded as h5py decodes them ]
An HDF5 string type declares its character set, ASCII or UTF-8. h5py reads string rows as
bytes; its ``dataset.asstr()`` decodes them with the declared codec, strictly, raising
UnicodeDecodeError on bytes that are not of it. fastloader gives the str ``asstr()`` gives, or
a PackError naming the file, the dataset and the sample where ``asstr()`` raises: never a str
carrying lone surrogates (what ``surrogateescape`` made of invalid bytes, issue 39: the
sample ``'t\\udceb2é'`` failed later, far from the read).

One widening, kept from earlier releases: strings declared ASCII are decoded as UTF-8 (ASCII's
superset). A NumPy ``S`` array of UTF-8 text is stored as ASCII, and users' files of names
written that way read as their text (where ``asstr()`` would raise); for ASCII bytes both
readings agree. So the one codec is ``TEXT_CODEC`` and only bytes that are not UTF-8 raise.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TEXT_CODEC", "TextError", "decode_column"]

TEXT_CODEC = "utf-8"  # for both declared charsets: see the NOTE above


class TextError(ValueError):
    """A row of a string column that is not text of its declared codec."""

    def __init__(self, at: int, error: UnicodeDecodeError) -> None:
        super().__init__(at, error)
        self.at = at  # the row's position in the column
        self.error = error


def decode_column(texts: list, encoding: str = TEXT_CODEC) -> list:
    """``texts`` (``tolist()`` of string rows: bytes, or nested lists of bytes for rows of
    several strings) as str, decoded strictly with ``encoding``.

    Raises:
        TextError: naming the first row that does not decode.
    """
    try:
        try:  # rows of one bytes string each, the usual
            return [text.decode(encoding) for text in texts]
        except AttributeError:
            return [_text(value, encoding) for value in texts]
    except UnicodeDecodeError:
        for at, value in enumerate(texts):
            try:
                _text(value, encoding)
            except UnicodeDecodeError as error:
                raise TextError(at, error) from None
        raise  # not reached: a row failed above


def _text(value: Any, encoding: str) -> str | list:
    """A string row as str; rows of several strings (a ``(N, 2)`` dataset) as a list of str,
    nested as the row's shape."""
    if isinstance(value, (list, tuple)):
        return [_text(item, encoding) for item in value]
    if isinstance(value, bytes):
        return value.decode(encoding)
    if hasattr(value, "tolist"):  # a variable-length string row h5py gives as objects
        return _text(value.tolist(), encoding)
    return str(value)
