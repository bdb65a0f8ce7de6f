"""Sphinx configuration for the celery-anarchon documentation.

Pages are MyST Markdown; the API page is autodoc over Google-style
docstrings (napoleon). Built in CI with warnings as errors:
``sphinx-build -W -b html docs docs/_build/html``.
"""

from __future__ import annotations

import re

import celery_anarchon

project = "celery-anarchon"
author = "celery-anarchon developers"
release = version = celery_anarchon.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence"]
# Mermaid diagrams (docs/architecture.md) render where Mermaid is drawn
# (GitHub, the MyST preview); Sphinx shows their source, unhighlighted.
suppress_warnings = ["misc.highlighting_failure"]
myst_heading_anchors = 3
exclude_patterns = ["_build"]
html_theme = "alabaster"
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_attr_annotations = True
nitpicky = False

# Google-style sections napoleon should also read (backend docstrings list
# their options like arguments).
napoleon_custom_sections = [("Options", "params_style")]

_INLINE_SECTION = re.compile(
    r"^(?P<indent>\s*)(?P<text>\S.*?[.:])\s+(?P<section>Raises|Returns):\s*$"
)
_NOTED_SECTION = re.compile(r"^(?P<indent>\s*)(?P<section>Options) \((?P<note>.+)\):\s*$")


def _sections_on_their_own_lines(app, what, name, obj, options, lines):
    """Let napoleon see two docstring habits of this code base as sections:
    ``Idempotent. Raises:`` (a section header at the end of a sentence) and
    ``Options (where they are set):`` (a header with a note)."""
    fixed: list[str] = []
    for line in lines:
        inline = _INLINE_SECTION.match(line)
        noted = _NOTED_SECTION.match(line)
        if inline:
            indent = inline["indent"]
            fixed += [indent + inline["text"], "", f"{indent}{inline['section']}:"]
        elif noted:
            indent = noted["indent"]
            fixed += [f"{indent}{noted['section']} are given as {noted['note']}.", ""]
            fixed.append(f"{indent}{noted['section']}:")
        else:
            fixed.append(line)
    lines[:] = fixed


def setup(app):
    # Before napoleon (priority 500) turns the sections into fields.
    app.connect("autodoc-process-docstring", _sections_on_their_own_lines, priority=400)
