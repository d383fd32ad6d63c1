"""Where a text is written: the `Line`s, `Site`s and `Insertion`s the analysis reports.

A value reaches a knob through the walk as a `Text` that remembers where each piece of it was
written; this turns those origins into spans of the files as the caller passed them (string and
UTF-8 byte offsets, the line each is on) so that a value can be replaced where the user wrote it
and nothing else moves. It knows the files and nothing of knobs.

Each line is read once, however many sites it holds: a `Line` is kept per line and shared, and
a byte offset is counted from a table of every `_BYTE_CHUNK`th character's, not by encoding the
line up to it. (Before, each site sliced its whole line anew and encoded it up to the offset: a
one-line script of 1 MB setting a flag 65,000 times held 65,000 copies of the line, 24 GB.)
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Mapping

from daemon.importer.configs import ConfigFormat
from daemon.importer.evaluate import ArgsEnd
from daemon.importer.records import Form, Insertion, Line, Site
from daemon.importer.values import Text, written_length

MAX_PIECES = 64  # places of an assembled value worth reporting
_BYTE_CHUNK = 4096  # characters between two entries of a file's table of byte offsets


class Places:
    """The files of one analysis (the script and those given with it), with their line numbers
    and UTF-8 byte offsets computed once per file."""

    def __init__(self, texts: Mapping[str, str]) -> None:
        self.texts = texts
        self._starts: dict[str, array[int]] = {}
        self._byte_chunks: dict[str, array[int] | None] = {}  # None: ASCII, bytes are characters
        self._lines: dict[tuple[str, int], Line] = {}

    def holds(self, file: str) -> bool:
        """Whether `file` is one of the texts (not a file the script names but was not given)."""
        return file in self.texts

    def line(self, file: str, offset: int) -> Line:
        starts = self._index(file)
        number = bisect.bisect_right(starts, offset) - 1
        number = min(max(number, 0), len(starts) - 2)
        line = self._lines.get((file, number))
        if line is None:
            text = self.texts[file]
            end = starts[number + 1] - 1
            line = Line(file, number + 1, text[starts[number] : min(end, len(text))])
            self._lines[file, number] = line
        return line

    def site(self, file: str, start: int, end: int, form: Form, within: Form | None = None) -> Site:
        text = self.texts[file]
        byte_start, byte_end = self._bytes(file, start), self._bytes(file, end)
        return Site(
            file,
            start,
            end,
            byte_start,
            byte_end,
            self.line(file, start),
            form,
            text[start:end],
            within,
        )

    def text_site(self, text: Text) -> Site | None:
        """Where a text is written, when it is written in one place (or is one expression)."""
        runs = text.runs()
        if runs is not None and len(runs) == 1 and runs[0].file in self.texts:
            run = runs[0]
            return self.site(run.file, run.start, run.end, run.form or Form.SHELL_WORD)
        if len(text.segs) == 1 and text.segs[0].opaque:
            seg = text.segs[0]
            if seg.file is not None and seg.file in self.texts:
                end = seg.start + written_length(seg)
                return self.site(seg.file, seg.start, end, seg.form or Form.SHELL_WORD)
        return None

    def value_sites(
        self, text: Text, config_form: ConfigFormat | None
    ) -> tuple[Site | None, tuple[Site, ...]]:
        """The one place a value is written, or the pieces of an assembled one."""
        runs = text.runs()
        whole = runs is not None
        if runs is None:
            runs = text.located_runs()
        if len(runs) > MAX_PIECES:
            return None, ()
        sites = []
        for run in runs:
            form = run.form or Form.SHELL_WORD
            within = None
            if config_form is not None and form in {Form.HEREDOC, Form.HEREDOC_LITERAL}:
                within, form = form, config_form.form
            sites.append(self.site(run.file, run.start, run.end, form, within))
        if whole and len(sites) == 1:
            return sites[0], ()
        return None, tuple(dict.fromkeys(sites))

    def lines_through(self, use: Text | None, value: Text | None) -> tuple[Line, ...]:
        """The lines a value passed through: where its flag or key is used, the variables it
        was read from on the way."""
        lines: list[Line] = []
        if use is not None:
            origin = use.origin_at(0)
            if origin is not None and origin[0] in self.texts:
                lines.append(self.line(origin[0], origin[1]))
            if use.segs:
                for frame in use.segs[0].frames:
                    lines.append(self.line(frame.file, frame.start))
        if value is not None:
            for seg in [*value.segs[:1], *value.unknowns()[:1]]:
                for frame in seg.frames:
                    if frame.file in self.texts:
                        lines.append(self.line(frame.file, frame.start))
        return tuple(dict.fromkeys(lines))

    def args_end(self, ends: ArgsEnd) -> Insertion:
        """Where a flag can be appended to a command's arguments: after its last word, before
        any redirection, pipe or `&&`. Inside a command built from strings, after the outermost
        `$X` whose value ends with that word (and no newline, which would end the command when
        the string is read as code), else right after the word where it is written."""
        source = ends.source
        mapped = source.mapped
        if mapped is None:
            line = self.line(source.file, max(ends.offset - 1, 0))
            return Insertion(
                source.file, ends.offset, Form.SHELL_WORD, line, "after the command's last argument"
            )
        index = ends.offset - 1
        if index < 0:
            return Insertion(source.file, None, None, None, "the command has no arguments")
        for frame in mapped.frames_at(index):
            ends_here = frame.offset == frame.last and not frame.tail_newline
            if ends_here and frame.file in self.texts:
                line = self.line(frame.file, frame.start)
                return Insertion(
                    frame.file,
                    frame.end,
                    frame.form,
                    line,
                    "after the variable that ends the command's arguments",
                )
        end = mapped.end_at(index)
        if end is None or end[0] not in self.texts:
            return Insertion(
                source.file,
                None,
                None,
                None,
                "the command's last argument is computed, not written in the script",
            )
        file, offset, form = end
        line = self.line(file, max(offset - 1, 0))
        return Insertion(file, offset, form, line, "after the command's last argument")

    def _index(self, file: str) -> array[int]:
        """Where each line of `file` starts, and one past its end (as if a newline followed)."""
        starts = self._starts.get(file)
        if starts is None:
            text = self.texts[file]
            starts = array("q", [0])
            newline = text.find("\n")
            while newline >= 0:
                starts.append(newline + 1)
                newline = text.find("\n", newline + 1)
            starts.append(len(text) + 1)
            self._starts[file] = starts
        return starts

    def _bytes(self, file: str, offset: int) -> int:
        """The UTF-8 offset of a character offset: from the table, then at most one chunk."""
        text = self.texts[file]
        if file not in self._byte_chunks:
            chunks = None
            if not text.isascii():
                chunks = array("q", [0])
                for begin in range(0, len(text), _BYTE_CHUNK):
                    piece = text[begin : begin + _BYTE_CHUNK]
                    chunks.append(chunks[-1] + len(_encode(piece)))
            self._byte_chunks[file] = chunks
        chunks = self._byte_chunks[file]
        offset = min(max(offset, 0), len(text))
        if chunks is None:
            return offset
        chunk = offset // _BYTE_CHUNK
        return chunks[chunk] + len(_encode(text[chunk * _BYTE_CHUNK : offset]))


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")
