"""The README is for users (short, a runnable snippet first, the decision table, links that resolve) and the docs site
holds the rest: every page of ``docs/`` in the nav of ``mkdocs.yml``, and ``mkdocs build --strict`` (broken links and
anchors are errors there) passes."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 200
SNIPPET_WITHIN = 40
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")

has_mkdocs = all(importlib.util.find_spec(m) is not None for m in ("mkdocs", "material", "mkdocstrings"))
needs_mkdocs = pytest.mark.skipif(not has_mkdocs, reason='MkDocs is not installed: pip install -e ".[docs]"')


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _nav_pages(nav) -> list[str]:
    """The pages a mkdocs.yml nav names, at any depth."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return [page for item in nav for page in _nav_pages(item)]


def _mkdocs_config() -> dict:
    # mkdocs.yml may hold tags (!ENV, !relative) that safe_load refuses; none is needed for the nav
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    return yaml.load(ROOT.joinpath("mkdocs.yml").read_text(), Loader=Loader)


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move detail into a page of docs/"
    )


def test_readme_opens_with_a_python_snippet():
    lines = README.read_text().splitlines()
    fences = [i for i, line in enumerate(lines[:SNIPPET_WITHIN]) if line.strip() == "```python"]
    assert fences, f"README.md: no ```python snippet opens within its first {SNIPPET_WITHIN} lines"
    start = fences[0] + 1
    end = lines.index("```", start)
    ast.parse("\n".join(lines[start:end]))  # the snippet is Python, whole


def test_readme_has_the_decision_table():
    section = _section(README.read_text(), "Should I use it?")
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert len(rows) >= 2 + 4, "README.md, 'Should I use it?': the decision table (header, rule, a row per case)"
    table = "\n".join(rows)
    choices = ['"zeropp"', '"hsdp"', '"zero3"', "gradient_bits=8", "quantize_gradients_steps",
               "lightning_zeropp.planner"]  # fmt: skip
    for choice in choices:
        assert choice in table, f"README.md's decision table does not name {choice}"
    assert re.search(r"^\| one node \|", table, re.M), "README.md's decision table has no row for one node"
    assert "docs/accuracy.md" in section, "the accuracy recommendation links its evidence"


def test_readme_links_resolve():
    text = README.read_text()
    relative = [t for t in LINK.findall(text) if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", t, re.I)]
    assert relative, "README.md links no file of the repository"
    missing = [t for t in relative if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links files that do not exist: {missing}"


def test_every_docs_page_is_in_the_nav():
    config = _mkdocs_config()
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if "hooks" not in p.parts)
    assert sorted(set(nav)) == sorted(nav), f"mkdocs.yml names a page twice: {nav}"
    assert sorted(nav) == pages, (
        f"mkdocs.yml's nav and docs/ differ: not in the nav {sorted(set(pages) - set(nav))}, "
        f"in the nav without a page {sorted(set(nav) - set(pages))}"
    )
    assert config["validation"]["links"]["anchors"] == "warn" and config["validation"]["links"]["not_found"] == "warn"


def _hook():
    spec = importlib.util.spec_from_file_location("docs_hook_repository", DOCS / "hooks" / "repository.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_mkdocs
def test_an_included_page_keeps_its_links(tmp_path):
    hook = _hook()
    (tmp_path / "bench").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench" / "RESULTS.md").write_text("# R\n\n![plot](plot.png) [x](https://e.org) `[y](z.png)`\n")
    page = tmp_path / "docs" / "all.md"
    text = hook.expand_includes("intro\n<!-- include: ../bench/RESULTS.md -->\nend\n", page, tmp_path)
    assert text == "intro\n# R\n\n![plot](../bench/plot.png) [x](https://e.org) `[y](z.png)`\nend\n"
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="names no file"):
        hook.expand_includes("<!-- include: ../bench/MISSING.md -->\n", page, tmp_path)


@needs_mkdocs
def test_a_section_of_a_page_is_included_alone(tmp_path):
    hook = _hook()
    (tmp_path / "docs").mkdir()
    readme = (
        "# T\n\n## Should I use it?\n\n| a | [b](docs/p.md) |\n\n### Long runs\n\nx\n\n"
        "```\n## not a heading\n```\n\n## Next\n\nz\n"
    )
    (tmp_path / "README.md").write_text(readme)
    page = tmp_path / "docs" / "index.md"
    text = hook.expand_includes("<!-- include: ../README.md#should-i-use-it -->\n", page, tmp_path)
    assert text == "| a | [b](p.md) |\n\n### Long runs\n\nx\n\n```\n## not a heading\n```\n"
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="no heading with the anchor #nowhere"):
        hook.expand_includes("<!-- include: ../README.md#nowhere -->\n", page, tmp_path)


@pytest.mark.slow  # 3 s on an idle machine, 7-11 s beside a training run: a subprocess building the whole site
@needs_mkdocs
def test_the_docs_build_strictly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    site = tmp_path / "site"
    assert "zeropp-gpt" in (site / "launching" / "index.html").read_text()  # the included batch file
    # a linked repository file, published
    assert (site / "repository" / "benchmarks" / "data" / "planner" / "plan_7b.png").is_file()
    assert "Long runs" in (site / "index.html").read_text()  # the README's decision table, included in the guide


def test_the_api_reference_covers_every_export_and_every_kernel_op():
    """docs/api.md renders each public name from its docstring: everything ``lightning_zeropp`` exports, the Fabric
    strategy, and the kernels' ops (a name added to ``__all__`` without a page entry fails here)."""
    import lightning_zeropp
    from lightning_zeropp import kernels

    page = (DOCS / "api.md").read_text()
    rendered = set(re.findall(r"^::: ([\w.]+)", page, re.M))
    listed = set(re.findall(r"^        - (\w+)$", page, re.M))  # the kernels' members
    missing = [n for n in lightning_zeropp.__all__ if f"lightning_zeropp.{n}" not in rendered]
    assert missing == [] and "lightning_zeropp.fabric.ZeroPPStrategy" in rendered, missing
    ops = {"quantize", "dequantize", "swizzle_quantize", "dequantize_reduce_quantize", "dequantize_reduce"}
    assert ops <= set(kernels.__all__) and ops | {"Blocks", "check_backend"} <= listed, listed
