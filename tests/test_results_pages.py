"""The results pages against their data: ``benchmarks/report.py`` generates ``docs/results/`` (and the figures the
README and the docs quote) from ``benchmarks/data/``; a page or a quoted figure that differs from what its data gives
fails here, as does data no page reads, data without a manifest, and a page missing from the site's nav."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import record  # noqa: E402
import report  # noqa: E402


def test_every_page_and_quoted_figure_matches_its_data():
    assert report.drifted() == [], "run `python benchmarks/report.py` and commit what it writes"


@pytest.fixture
def copy_of_the_repository(tmp_path, monkeypatch):
    """The report pointed at a copy of the data, the pages and the quoting files, so a test can change them."""
    data = tmp_path / "data"
    shutil.copytree(report.DATA, data)
    pages = tmp_path / "docs" / "results"
    shutil.copytree(report.PAGES_DIR, pages)
    quoting = []
    for path in report.QUOTING:
        copy = tmp_path / path.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, copy)
        quoting.append(copy)
    shutil.copy(report.HERE / "RESULTS.md", tmp_path / "RESULTS.md")
    monkeypatch.setattr(report, "DATA", data)
    monkeypatch.setattr(report, "PAGES_DIR", pages)
    monkeypatch.setattr(report, "QUOTING", quoting)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "HERE", tmp_path)
    assert report.drifted() == []
    return tmp_path


def test_a_new_figure_in_the_data_makes_its_page_drift(copy_of_the_repository):
    path = report.DATA / "bytes_per_step" / "comm_volume.json"
    rows = json.loads(path.read_text())
    row = next(r for r in rows if r["config"] == "zeropp")
    row["inter_node_bytes_per_step"] += 1000
    path.write_text(json.dumps(rows))
    assert "docs/results/bytes_per_step.md" in report.drifted()
    assert report.main([]) == 0  # regenerated
    assert report.drifted() == []


def test_a_page_edited_by_hand_drifts(copy_of_the_repository):
    page = report.PAGES_DIR / "accuracy.md"
    page.write_text(page.read_text().replace("±", "+-", 1))
    assert report.drifted() == ["docs/results/accuracy.md"]


def test_a_quoted_figure_edited_by_hand_drifts(copy_of_the_repository):
    readme = copy_of_the_repository / "README.md"
    text = readme.read_text()
    start = text.index("<!-- results: ")
    body = text.index("-->", start) + 3
    assert text[body] != "<", "the README's first quoted figure is empty"
    readme.write_text(text[:body] + "9" + text[body:])
    assert report.drifted() == ["README.md"]


def test_a_quote_of_an_unknown_figure_is_refused(copy_of_the_repository):
    readme = copy_of_the_repository / "README.md"
    readme.write_text(readme.read_text() + "\n<!-- results: bytes_per_step/nothing -->1<!-- /results -->\n")
    with pytest.raises(SystemExit, match="bytes_per_step/nothing"):
        report.drifted()


def test_every_data_file_is_read_by_a_page_and_has_a_manifest():
    read = {src for name in report.PAGES for src in report.renderer(name).SOURCES}
    for path in sorted(report.DATA.rglob("*.json")):
        if path.name.endswith(".manifest.json"):
            continue
        rel = path.relative_to(report.DATA).as_posix()
        assert record.manifest_path(path).is_file(), f"benchmarks/data/{rel}: no manifest beside it"
        entries = record.read_manifest(path)
        assert entries and all(e.get("command") or e.get("commands") for e in entries), f"{rel}: no command"
        if rel.startswith("archive/"):
            continue
        assert rel in read, f"benchmarks/data/{rel}: no page reads it (a renderer's SOURCES, or archive/)"


def test_the_site_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    for name in [*report.PAGES, "index"]:
        assert f"results/{name}.md" in nav, f"mkdocs.yml's nav lacks results/{name}.md"
    assert "decisions.md" in nav


def test_results_md_lists_the_newest_runs_with_their_commands_and_the_figures_their_pages_name():
    pages = [report.build(name) for name in report.PAGES]
    text = report.index(pages, prefix="../docs/results/", newest=True)
    rows = [line for line in text.split("## The newest runs", 1)[1].splitlines() if line.startswith("| 20")]
    assert len(rows) == report.NEWEST
    dates = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert dates == sorted(dates, reverse=True)
    # every figure a page names for a data file is that page's snippet, never text written here
    for page in pages:
        for path, heads in getattr(report.renderer(page.name), "HEADLINES", {}).items():
            assert path in report.renderer(page.name).SOURCES, (page.name, path)
            for label, name in heads:
                assert name in page.snippets, (page.name, name)
                row = next((r for r in rows if f"`{path}`" in r), None)
                if row is not None:
                    assert f"{label}: {page.snippets[name]}" in row
    assert "## The newest runs" not in report.index(pages)


@pytest.mark.parametrize(("seconds", "want"), [(899.547, "14 min 59.5 s"), (64.0, "1 min 4 s"), (59.96, "1 min 0 s")])
def test_the_suite_page_rounds_a_time_once(seconds, want):
    from pages.suite import minutes_text

    assert minutes_text(seconds) == want
