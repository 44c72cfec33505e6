"""The one writer every ``robust bench`` benchmark uses: a marked section of a Markdown file."""

from __future__ import annotations

from pathlib import Path

from robust_plugins.errors import ConfigError


def write_section(path: Path, name: str, body: str, title: str = "Gradient compression") -> None:
    """Replace the text between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``.

    The markers stay; a missing file is created with a title, a missing section is appended under
    a ``## title`` heading.
    """
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    i, j = text.find(start), text.find(end)
    if (i < 0) != (j < 0) or (i >= 0 and j < i):
        raise ConfigError(f"{path}: found only one of the markers {start} / {end} (or out of order); "
                          f"fix the file by hand.")
    if i >= 0:
        text = text[:i] + block + text[j + len(end):]
    else:
        text = text.rstrip("\n") + f"\n\n## {title}\n\n{block}\n"
    path.write_text(text)
