"""A streaming scanner for one JSON array of rows: yields each top-level value's bytes without parsing the
whole file, so a ``.json`` file of any size is read one row at a time and an oversized row is passed over in
bounded steps.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import BinaryIO

from dspark_precompute.errors import DataError
from dspark_precompute.write.samples.files import READ_CHUNK, UTF8_BOM

_NON_WS = re.compile(rb"[^ \t\r\n]")


_STRUCT = re.compile(rb'[\[\]{}"]')


_STRING_STOP = re.compile(rb'["\\]')


_SCALAR_END = re.compile(rb"[ \t\r\n,\]}]")


class JsonValues:
    """The top-level values of a JSON file, found in bounded chunks without parsing the file.

    A top-level array gives its elements; otherwise each top-level value is one (a single
    object, or JSON lines saved as .json). Each comes back as (line, bytes, size) with
    bytes None when the value is larger than ``limit``: it is scanned past, never held.
    Structure (brackets, strings, escapes) is tracked only to find where values end; each
    value's own syntax is checked when it is parsed.
    """

    def __init__(self, fh: BinaryIO, rel: str, limit: int, chunk: int = READ_CHUNK):
        self.fh, self.rel, self.limit, self.chunk = fh, rel, limit, chunk
        self.buf = bytearray()
        self.pos = 0  # scan position in buf
        self.base = 0  # file offset of buf[0]
        self.keep: int | None = None  # file offset of the value being held, None when none is
        self.mark, self.line = 0, 1  # line number at buf[mark]

    def _line_at(self, i: int) -> int:
        self.line += self.buf.count(b"\n", self.mark, i)
        self.mark = i
        return self.line

    def _fill(self) -> bool:
        """Read the next chunk, dropping what is no longer needed. False at end of file."""
        if self.keep is not None and self.base + len(self.buf) - self.keep > self.limit:
            self.keep = None  # the value is over the limit: stop holding it
        drop = self.pos if self.keep is None else self.keep - self.base
        data = self.fh.read(self.chunk)
        if not data:
            return False
        if drop > self.mark:
            self._line_at(drop)
        del self.buf[:drop]
        self.base += drop
        self.pos -= drop
        self.mark -= drop
        self.buf += data
        return True

    def _error(self, what: str) -> DataError:
        line = self._line_at(max(self.mark, min(self.pos, len(self.buf))))
        return DataError(f"{self.rel}: not valid JSON near line {line} (byte {self.base + self.pos}): {what}; "
                         "fix the file, or save it as JSON lines (.jsonl) so a bad row is only that row's loss")

    def _peek(self) -> int | None:
        """The next non-whitespace byte, not consumed; None at end of file."""
        while True:
            m = _NON_WS.search(self.buf, self.pos)
            if m is not None:
                self.pos = m.start()
                return self.buf[self.pos]
            self.pos = len(self.buf)
            if not self._fill():
                return None

    def _string(self) -> None:
        """Move past the closing quote of a string whose opening quote is consumed."""
        while True:
            m = _STRING_STOP.search(self.buf, self.pos)
            if m is None:
                self.pos = len(self.buf)
                if not self._fill():
                    raise self._error("the file ends inside a string")
                continue
            self.pos = m.end()
            if m.group() == b'"':
                return
            if self.pos >= len(self.buf) and not self._fill():  # a backslash: skip the byte it escapes
                raise self._error("the file ends inside a string")
            self.pos += 1

    def _value(self) -> tuple[int, bytes | None, int]:
        start = self.base + self.pos
        line = self._line_at(self.pos)
        self.keep = start
        first = self.buf[self.pos]
        self.pos += 1
        if first in b"[{":
            depth = 1
            while depth:
                m = _STRUCT.search(self.buf, self.pos)
                if m is None:
                    self.pos = len(self.buf)
                    if not self._fill():
                        raise self._error(f"the file ends inside the value that starts at line {line}")
                    continue
                self.pos = m.end()
                c = m.group()
                if c == b'"':
                    self._string()
                else:
                    depth += 1 if c in b"[{" else -1
        elif first == ord('"'):
            self._string()
        else:  # a number, true/false/null or garbage: up to the next delimiter
            while True:
                m = _SCALAR_END.search(self.buf, self.pos)
                if m is not None:
                    self.pos = m.start()
                    break
                self.pos = len(self.buf)
                if not self._fill():
                    break
        size = self.base + self.pos - start
        held = self.keep is not None and size <= self.limit
        data = bytes(self.buf[start - self.base:self.pos]) if held else None
        self.keep = None
        return line, data, size

    def __iter__(self) -> Iterator[tuple[int, bytes | None, int]]:
        self._fill()
        if self.buf.startswith(UTF8_BOM):
            self.pos = len(UTF8_BOM)
        c = self._peek()
        if c is None:
            return
        if c != ord("["):
            while self._peek() is not None:
                yield self._value()
            return
        self.pos += 1
        while True:
            c = self._peek()
            if c is None:
                raise self._error("the file ends inside the top-level array")
            if c == ord("]"):
                break
            yield self._value()
            c = self._peek()
            if c == ord(","):
                self.pos += 1
                continue
            if c == ord("]"):
                break
            raise self._error("expected ',' or ']' after an element of the top-level array"
                              if c is not None else "the file ends inside the top-level array")
        self.pos += 1
        if self._peek() is not None:
            raise self._error("more data after the top-level array")
