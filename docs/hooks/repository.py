"""MkDocs hook: the docs pages may point at files of the repository outside ``docs/``.

A page links a repository file by its path relative to the page, as GitHub reads it
(``../benchmarks/data/planner/plan_7b.png``, ``../examples/gpt/slurm/train.sbatch``): the hook publishes that file
with the site (under ``repository/``) and points the link there, so the same link works on GitHub and in the built
site. A target that does not exist is left alone,
and MkDocs' link check reports it (``mkdocs build --strict`` fails on it). Links to Markdown files outside ``docs/``
are refused: MkDocs would build them as pages outside the nav; include them instead.

A line ``<!-- include: PATH -->`` (PATH relative to the page, as a link) is replaced by the file's text: verbatim (a
script inside a code fence, shown as it is in the repository), except that a Markdown file's own relative links are
rewritten to be relative to the including page. ``<!-- include: PATH#ANCHOR -->`` includes one section of a Markdown
file, the body under the heading with that anchor: the user guide shows the README's decision table so.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

PUBLISHED = "repository"
"""Where the site holds the repository files the pages link to."""

INCLUDE = re.compile(r"^[ \t]*<!-- include: (?P<path>\S+) -->[ \t]*$", re.M)
LINK = re.compile(r"(?P<open>!?\[[^\]\n]*\]\()(?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?(?P<close>\))")
"""An inline Markdown link or image whose target has no spaces: ``[text](target#anchor)``."""


def _is_relative(target: str) -> bool:
    return not re.match(r"^([a-z][a-z0-9+.-]*:|/|#)", target, re.I)


def _repository(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent


def expand_includes(text: str, page: Path, root: Path) -> str:
    """``text`` of the page at ``page`` with every include directive replaced by the file it names.

    Raises:
        PluginError: an included file does not exist or lies outside the repository ``root``.
    """

    def include(match: re.Match) -> str:
        target, _, section = match["path"].partition("#")
        path = (page.parent / target).resolve()
        if not path.is_file() or not path.is_relative_to(root):
            raise PluginError(f"{page.name}: `<!-- include: {match['path']} -->` names no file of the repository")
        body = path.read_text()
        if section:
            body = section_of(body, section, f"{page.name}: `<!-- include: {match['path']} -->`")
        if path.suffix == ".md":
            body = rewrite_links(body, lambda target: posixpath.relpath(path.parent / target, page.parent))
        return body.rstrip("\n")

    return INCLUDE.sub(include, text)


HEADING = re.compile(r"^(?P<level>#{1,6})[ \t]+(?P<title>.+?)[ \t]*$", re.M)


def slug(title: str) -> str:
    """A heading's anchor as MkDocs' table of contents makes it: ``"Should I use it?"`` -> ``should-i-use-it``."""
    text = re.sub(r"[^\w\s-]", "", title.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def section_of(text: str, anchor: str, where: str) -> str:
    """The body of the Markdown section whose heading's anchor is ``anchor``: the lines after its heading up to the
    next heading of the same level or above (code fences skipped).

    Raises:
        PluginError: no heading has that anchor.
    """
    fenced = [(m.start(), m.end()) for m in re.finditer(r"^```.*?^```", text, re.S | re.M)]
    headings = [m for m in HEADING.finditer(text) if not any(a <= m.start() < b for a, b in fenced)]
    for i, m in enumerate(headings):
        if slug(m["title"]) == anchor:
            level = len(m["level"])
            end = next((h.start() for h in headings[i + 1 :] if len(h["level"]) <= level), len(text))
            return text[m.end() : end].strip("\n")
    raise PluginError(f"{where}: no heading with the anchor #{anchor}")


def rewrite_links(text: str, new_target) -> str:
    """``text`` with each relative link target replaced by ``new_target(target)`` (anchors kept); code spans and
    fenced blocks are left as they are."""

    def link(m: re.Match) -> str:
        target = new_target(m["target"]) if _is_relative(m["target"]) else m["target"]
        return m["open"] + target + (m["anchor"] or "") + m["close"]

    parts = re.split(r"(```.*?```|`[^`\n]*`)", text, flags=re.S)
    for i in range(0, len(parts), 2):  # the even parts lie outside code
        parts[i] = LINK.sub(link, parts[i])
    return "".join(parts)


def _outside_targets(text: str, page: Path, docs: Path, root: Path) -> dict[str, Path]:
    """The relative link targets of ``text`` (a page at ``page``) that are files of the repository outside ``docs``."""
    found = {}
    for match in LINK.finditer(re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S)):
        target = match["target"]
        if not _is_relative(target):
            continue
        path = (page.parent / target).resolve()
        if path.is_relative_to(docs) or not path.is_relative_to(root) or not path.is_file():
            continue
        if path.suffix == ".md":
            raise PluginError(
                f"{page.name} links {target}, a Markdown file outside docs/: include it in a page instead"
                " (`<!-- include: PATH -->`)"
            )
        found[target] = path
    return found


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Publishes every repository file outside ``docs/`` that a page links to."""
    root, docs = _repository(config), Path(config.docs_dir).resolve()
    published = set()
    for file in list(files.documentation_pages()):
        page = Path(file.abs_src_path)
        text = expand_includes(page.read_text(), page, root)
        for path in _outside_targets(text, page, docs, root).values():
            uri = posixpath.join(PUBLISHED, path.relative_to(root).as_posix())
            if uri not in published:
                published.add(uri)
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Expands the includes, then points each link to a repository file at its published copy."""
    root, docs = _repository(config), Path(config.docs_dir).resolve()
    source = Path(page.file.abs_src_path)
    markdown = expand_includes(markdown, source, root)
    outside = _outside_targets(markdown, source, docs, root)
    here = posixpath.dirname(page.file.src_uri)

    def published(target: str) -> str:
        if target not in outside:
            return target
        uri = posixpath.join(PUBLISHED, outside[target].relative_to(root).as_posix())
        return posixpath.relpath(uri, here or ".")

    return rewrite_links(markdown, published)
