"""The documentation: the site builds with ``mkdocs build --strict``, the README's links into
``docs/`` lead to pages and headings that exist, and the Python code blocks of the pages and of
the README run.

Each block runs alone in a fresh interpreter, in an empty folder that is also its ``HOME`` (so
the runs it makes go to that folder's ``~/lockstep_results``), with ``LOCKSTEP_DATA`` set as for
the other tests. A block that can't run here (it needs a Ray cluster, torchrun, a GPU or S3, or it
is a fragment) is marked in the Markdown by an HTML comment, the last non-blank line before the
block, that gives the reason::

    <!-- no-run: needs a Ray cluster -->

Every other block must exit 0 within ``BLOCK_TIMEOUT_S``. Identical blocks (the quickstart is in
the README and in docs/getting-started.md) run once. No block is skipped (with ``CI=true`` a skip
is an error): a marked block is simply not run, and the marked ones are counted and kept few.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import DATA_DIR, REPO_ROOT

DOCS_DIR = REPO_ROOT / "docs"
#: The Markdown files whose code blocks are run: the README and every page of the site.
DOC_FILES = [REPO_ROOT / "README.md", *sorted(DOCS_DIR.rglob("*.md"))]
NO_RUN = re.compile(r"^<!--\s*no-run:(?P<reason>.*?)-->$")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
PYTHON_LANGUAGES = {"python", "py", "python3"}
#: At most this many Python blocks may be marked no-run: each one is code that CI never runs.
MAX_NO_RUN = 4
BLOCK_TIMEOUT_S = 120
BUILD_TIMEOUT_S = 300


@dataclass(frozen=True)
class CodeBlock:
    """A fenced code block of a Markdown file."""

    path: Path
    line: int  #: the line of its opening fence, from 1
    language: str  #: the first word of the fence's info string, lower case ("" without one)
    code: str
    no_run: str | None  #: the reason of its no-run marker, None when it has none

    @property
    def where(self) -> str:
        """``file:line`` of the opening fence, the file relative to the repository."""
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}"

    @property
    def is_python(self) -> bool:
        """Whether the fence names Python (``python``, ``py`` or ``python3``)."""
        return self.language in PYTHON_LANGUAGES


@dataclass(frozen=True)
class ParsedDoc:
    """The code blocks of one Markdown file, and the lines of its markers that precede no Python block."""

    blocks: list[CodeBlock]
    stray_markers: list[int]


def parse_doc(path: Path) -> ParsedDoc:
    """The fenced code blocks of ``path`` and their no-run markers.

    A marker counts for the block whose opening fence is the next non-blank line after it, and
    only when that block is Python; any other marker outside code blocks is stray. Lines inside
    code blocks are never markers (a page may show one in a ``text`` block).
    """
    blocks: list[CodeBlock] = []
    strays: list[int] = []
    lines = path.read_text().splitlines()
    pending: tuple[int, str] | None = None  # a marker waiting for its block: (line, reason)
    index = 0
    while index < len(lines):
        line = lines[index]
        opening = FENCE.match(line)
        if opening is None:
            if line.strip():
                if pending is not None:
                    strays.append(pending[0])
                marker = NO_RUN.match(line.strip())
                pending = (index + 1, marker.group("reason").strip()) if marker else None
            index += 1
            continue
        fence, indent = opening.group("fence"), len(opening.group("indent"))
        info = opening.group("info").strip()
        language = info.split()[0].lower() if info else ""
        body: list[str] = []
        index += 1
        while index < len(lines):
            closing = FENCE.match(lines[index])
            if (
                closing
                and closing.group("fence")[0] == fence[0]
                and len(closing.group("fence")) >= len(fence)
                and not closing.group("info").strip()
            ):
                break
            text = lines[index]
            body.append(text[indent:] if text[:indent].strip() == "" else text.lstrip())
            index += 1
        start = index - len(body)  # the opening fence's line, counted from 1
        if pending is not None and language not in PYTHON_LANGUAGES:
            strays.append(pending[0])
        reason = pending[1] if pending is not None and language in PYTHON_LANGUAGES else None
        blocks.append(CodeBlock(path, start, language, "\n".join(body) + "\n", reason))
        pending = None
        index += 1  # past the closing fence
    if pending is not None:
        strays.append(pending[0])
    return ParsedDoc(blocks, strays)


PARSED = {path: parse_doc(path) for path in DOC_FILES}
PYTHON_BLOCKS = [block for parsed in PARSED.values() for block in parsed.blocks if block.is_python]
NO_RUN_BLOCKS = [block for block in PYTHON_BLOCKS if block.no_run is not None]


def blocks_to_run() -> list[CodeBlock]:
    """The unmarked Python blocks, each distinct code once (its first occurrence)."""
    seen: set[str] = set()
    unique = []
    for block in PYTHON_BLOCKS:
        if block.no_run is None and block.code not in seen:
            seen.add(block.code)
            unique.append(block)
    return unique


RUN_BLOCKS = blocks_to_run()


def readme_links() -> list[tuple[str, str]]:
    """The README's relative links into docs/: ``(page, anchor)``, the anchor "" when it has none."""
    text = (REPO_ROOT / "README.md").read_text()
    return [
        (match.group(1), match.group(2) or "")
        for match in re.finditer(r"\]\((docs/[^)#\s]+\.md)(?:#([^)\s]+))?\)", text)
    ]


@pytest.mark.timeout(BUILD_TIMEOUT_S + 30)
def test_the_site_builds_strictly_and_the_readme_links_into_it(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (warnings are errors: broken links and anchors, pages left out of
    the nav, docstrings mkdocstrings can't render) succeeds; every page the README links to is
    built, with the heading its link names."""
    site = tmp_path / "site"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(REPO_ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        cwd=tmp_path,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert completed.returncode == 0, f"mkdocs build --strict failed:\n{completed.stdout}\n{completed.stderr}"
    assert (site / "index.html").is_file() and (site / "api" / "lockstep.html").is_file()
    links = readme_links()
    assert links, "the README links to no docs page"
    for page, anchor in links:
        built = site / Path(page).relative_to("docs").with_suffix(".html")
        assert built.is_file(), f"the README links to {page}, which the site does not build"
        if anchor:
            assert f'id="{anchor}"' in built.read_text(), f"the README links to {page}#{anchor}: no such heading"


def test_the_docs_mark_the_few_blocks_they_do_not_run() -> None:
    """Every no-run marker stands right before a Python block and gives a reason; the marked
    blocks are few and there are blocks to run."""
    strays = [
        f"{path.relative_to(REPO_ROOT)}:{line}" for path, parsed in PARSED.items() for line in parsed.stray_markers
    ]
    assert not strays, f"no-run markers not followed by a Python code block: {strays}"
    unexplained = [block.where for block in NO_RUN_BLOCKS if not block.no_run]
    assert not unexplained, f"no-run markers without a reason: {unexplained}"
    assert RUN_BLOCKS, "no Python code block of the docs is run"
    assert len(NO_RUN_BLOCKS) <= MAX_NO_RUN, (
        f"{len(NO_RUN_BLOCKS)} Python blocks are marked no-run (at most {MAX_NO_RUN}): "
        + ", ".join(f"{block.where} ({block.no_run})" for block in NO_RUN_BLOCKS)
        + ". Make blocks runnable here (small data, this machine) rather than marking them."
    )


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 30)
@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[block.where for block in RUN_BLOCKS])
def test_a_docs_code_block_runs(block: CodeBlock, tmp_path: Path) -> None:
    """The block, as a script in an empty folder, exits 0 within ``BLOCK_TIMEOUT_S``."""
    script = tmp_path / f"{block.path.stem}_line{block.line}.py"
    script.write_text(block.code)
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "LOCKSTEP_DATA": str(DATA_DIR), "MPLBACKEND": "Agg"}
    process = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{block.where}: still running after {BLOCK_TIMEOUT_S} s; its output:\n{output[-4000:]}")
    assert process.returncode == 0, (
        f"{block.where} exited with {process.returncode} (mark it `<!-- no-run: why -->` only if it can't "
        f"run here); its output:\n{output[-4000:]}"
    )
