"""A MkDocs hook for the docstrings in src/, which keep some reStructuredText habits.

* Objects are named with Sphinx roles (``:class:`Result```), which Markdown renders as
  ``:class:<code>Result</code>``: each becomes its code span, linked to the object's API entry when
  the name is a full path the API pages document (an optional cross-reference of mkdocs-autorefs:
  a name it can't find stays plain code).
* A paragraph that introduces a literal block ends with ``::``; shown as one colon.
"""

from __future__ import annotations

import html
import re
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj|const):<code>(~?)([^<]+)</code>")
LITERAL_INTRO = re.compile(r"::</p>")


def _code(match: re.Match[str]) -> str:
    """The role's object as a code span; ``~a.b.C`` shows as ``C``, as in Sphinx."""
    short, target = match.group(1) == "~", html.unescape(match.group(2))
    target = target.removesuffix("()")
    shown = target.rsplit(".", 1)[-1] if short else match.group(2)
    if target.startswith("lockstep.") and not target.startswith("lockstep._internal"):
        return f'<autoref identifier="{html.escape(target)}" optional><code>{shown}</code></autoref>'
    return f"<code>{shown}</code>"


def on_page_content(html_text: str, **kwargs: Any) -> str:
    """Rewrite one page's HTML (MkDocs calls this for every page)."""
    return LITERAL_INTRO.sub(":</p>", ROLE.sub(_code, html_text))
