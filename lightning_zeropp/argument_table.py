"""The docs' table of arguments, generated from :class:`~lightning_zeropp.ZeroPPConfig` (and Fabric's own).

    python -m lightning_zeropp.argument_table                     # prints the table
    python -m lightning_zeropp.argument_table docs/arguments.md   # writes it between the markers there

``tests/test_arguments.py`` checks that ``docs/arguments.md`` holds exactly this table.
"""

from __future__ import annotations

import sys
from dataclasses import Field, fields
from pathlib import Path

from .config import RENAMED, ZeroPPConfig, doc, shown_default, when

PAGE = "docs/arguments.md"
"""The page that holds the table, relative to the repository's root."""
TABLE_START = f"<!-- arguments: generated from ZeroPPConfig by `python -m lightning_zeropp.argument_table {PAGE}` -->"
TABLE_END = "<!-- end of the generated arguments -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("``", "`")


def _default(f: Field) -> str:
    return f.metadata["shown"] if f.metadata.get("shown") else f"`{shown_default(f)}`"


def table(config_class: type[ZeroPPConfig] = ZeroPPConfig, own: dict[str, type] | None = None) -> str:
    """The table of arguments: every field of ``config_class`` (with its deprecated spelling, if any), then
    each front door's own arguments (``own``: front door name -> its dataclass; default: Fabric's)."""
    if own is None:
        from .fabric import FabricArguments

        own = {"Fabric": FabricArguments}
    formerly = {new: old for old, (new, _) in RENAMED.items()}
    rows = ["| argument | default | change it when | meaning |", "|---|---|---|---|"]
    for f in fields(config_class):
        meaning = doc(f) + (f" Deprecated spelling: `{formerly[f.name]}`." if f.name in formerly else "")
        rows.append(f"| `{f.name}` | {_default(f)} | {_cell(when(f))} | {_cell(meaning)} |")
    for front_door, arguments in own.items():
        rows += [f"| `{f.name}` | {_default(f)} | {_cell(when(f))} | {front_door} only: {_cell(doc(f))} |"
                 for f in fields(arguments)]  # fmt: skip
    return "\n".join([TABLE_START, *rows, TABLE_END])


def write_table(page: Path) -> bool:
    """Replaces the table between the markers of ``page``; returns whether the file changed.

    Raises:
        ValueError: ``page`` lacks the markers (the table goes in ``docs/arguments.md``).
    """
    text = page.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        raise ValueError(f"{page} has no generated table: its markers are {TABLE_START!r} and {TABLE_END!r} ({PAGE})")
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    new = text[:start] + table() + text[end:]
    page.write_text(new)
    return new != text


def main(argv: list[str]) -> None:
    if argv:
        print(f"{argv[0]}: {'updated' if write_table(Path(argv[0])) else 'already up to date'}")
    else:
        print(table())


if __name__ == "__main__":
    main(sys.argv[1:])
