"""The README's table of arguments, generated from :class:`~lightning_zeropp.ZeroPPConfig` (and Fabric's own).

    python -m lightning_zeropp.argument_table            # prints the table
    python -m lightning_zeropp.argument_table README.md  # writes it between the markers there

``tests/test_arguments.py`` checks that the README holds exactly this table.
"""

from __future__ import annotations

import sys
from dataclasses import Field, fields
from pathlib import Path

from .config import RENAMED, ZeroPPConfig, doc, shown_default

TABLE_START = "<!-- arguments: generated from ZeroPPConfig by `python -m lightning_zeropp.argument_table README.md` -->"
TABLE_END = "<!-- end of the generated arguments -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("``", "`")


def _default(f: Field) -> str:
    return f.metadata["shown"] if f.metadata.get("shown") else f"`{shown_default(f)}`"


def table(config_class: type[ZeroPPConfig] = ZeroPPConfig, own: dict[str, type] | None = None) -> str:
    """The README's table of arguments: every field of ``config_class`` (with its deprecated spelling, if any), then
    each front door's own arguments (``own``: front door name -> its dataclass; default: Fabric's)."""
    if own is None:
        from .fabric import FabricArguments

        own = {"Fabric": FabricArguments}
    formerly = {new: old for old, (new, _) in RENAMED.items()}
    rows = ["| argument | default | meaning |", "|---|---|---|"]
    for f in fields(config_class):
        meaning = doc(f) + (f" Deprecated spelling: `{formerly[f.name]}`." if f.name in formerly else "")
        rows.append(f"| `{f.name}` | {_default(f)} | {_cell(meaning)} |")
    for front_door, arguments in own.items():
        rows += [f"| `{f.name}` | {_default(f)} | {front_door} only: {_cell(doc(f))} |" for f in fields(arguments)]
    return "\n".join([TABLE_START, *rows, TABLE_END])


def write_table(readme: Path) -> bool:
    """Replaces the table between the markers of ``readme``; returns whether the file changed."""
    text = readme.read_text()
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    new = text[:start] + table() + text[end:]
    readme.write_text(new)
    return new != text


def main(argv: list[str]) -> None:
    if argv:
        print(f"{argv[0]}: {'updated' if write_table(Path(argv[0])) else 'already up to date'}")
    else:
        print(table())


if __name__ == "__main__":
    main(sys.argv[1:])
