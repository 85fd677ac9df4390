"""docs/benchmarks.md, the page of measured figures, written by the benchmark scripts.

Each script owns one section of the page, ``<!-- begin NAME -->`` ... ``<!-- end NAME -->``; with
``--write`` it replaces that section (or appends it, under a ``## NAME`` heading, when the page
lacks it) with what it printed, the command that printed it and the machine it ran on, so a
figure on the page always says where it came from. Text outside the markers is the page's own.

    with page.recorded("book-build", write=args.write):
        ...   # everything printed here is kept
"""
from __future__ import annotations

import contextlib
import io
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"


def machine() -> str:
    """The machine a measurement ran on, in one line: date, cores, load, CPU, Python."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cpu = platform.processor() or platform.machine()
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores "
            f"({cpu}), load average {load:.1f}, Python {platform.python_version()}")


def write_section(name: str, body: str, page: Path | None = None) -> None:
    """Put ``body`` between NAME's markers on ``page`` (docs/benchmarks.md), replacing what was
    there."""
    page = page or PAGE
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    text = page.read_text() if page.is_file() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n## {name}\n\n{block}\n"
    page.write_text(text if text.endswith("\n") else text + "\n")


class _Tee(io.TextIOBase):
    """A stdout that also keeps what passes through it."""

    def __init__(self, out):
        self.out, self.kept = out, io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def recorded(name: str, write: bool, fenced: bool = True):
    """Keep what the block prints; with ``write``, make it section NAME of the page, headed by
    the command line and :func:`machine` (``fenced``: as printed, in a code block; otherwise the
    printed text is markdown already)."""
    tee, before = _Tee(sys.stdout), sys.stdout
    sys.stdout = tee
    try:
        yield tee
    finally:
        sys.stdout = before
    if write:
        cmd = "python " + " ".join(shlex.quote(a) for a in
                                   [os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:]
                                   if a != "--write")
        out = tee.kept.getvalue().strip()
        body = f"`{cmd}`, {machine()}:\n\n" + (f"```\n{out}\n```" if fenced else out)
        write_section(name, body)
        print(f"wrote section {name} of {PAGE}", file=sys.stderr)


def readme_column(header: str, values: dict[str, str], readme: Path | None = None) -> None:
    """Set the README notebook table's column ``header`` (added before the last column when the
    table lacks it) to ``values`` (notebook number -> cell; a number not given keeps its cell,
    or gets ``-`` in a new column). Each benchmark owns its own column."""
    path = readme or ROOT / "README.md"
    lines = path.read_text().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("| no | notebook | paper"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[start:end]]
    head = rows[0]
    if header not in head:
        at = len(head) - 1
        for r in rows:
            r.insert(at, header if r is head else "----" if r is rows[1] else "-")
    col = head.index(header)
    for r in rows[2:]:
        if r[0] in values:
            r[col] = values[r[0]]
    lines[start:end] = ["| " + " | ".join(r) + " |" if i != 1 else "|" + "----|" * len(r)
                        for i, r in enumerate(rows)]
    path.write_text("\n".join(lines))
