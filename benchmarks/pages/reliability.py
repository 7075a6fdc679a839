"""Faults injected for real and timed: how the job ends when something goes wrong (``reliability.py``)."""

from __future__ import annotations

import re

from pages import Source, table

TITLE = "Faults injected"
QUESTION = """Does every rank stop with an error that says why when a rank freezes or dies or the job is misdescribed?

Four gloo ranks as 2 nodes x 2 train a small model with qwZ, hpZ and qgZ on, and one scenario at a time goes wrong:
a rank freezes (SIGSTOP) or dies mid-step, the launcher and the Trainer disagree on the job's shape, a YAML value is
out of range. Each row holds what was expected, what happened (the first line a user sees, cut short by the script),
and how long it took. The checkpoint faults (a save killed at every point, a full disk, another optimizer, a
truncated shard) are tests of their own: `tests/test_checkpoint_paths.py` and `tests/test_checkpoint_errors.py`."""

SOURCES = ["reliability/reliability.json"]

SOURCE_PATH = re.compile(r"\[/[^\]]*\] ")
"""A gloo error's build path (``[/__w/pytorch/.../pair.cc:537] ``): left out of the page, the message kept."""


def _observed(text: str) -> str:
    return SOURCE_PATH.sub("", text)


def render(sources: dict[str, Source]) -> str:
    data = sources[SOURCES[0]].data
    ok = [r for r in data if r["ok"]]
    rows = [[r["scenario"], r["expected"], _observed(r["observed"]), f"{r['seconds']:.1f}",
             "yes" if r["ok"] else "**no**"] for r in data]  # fmt: skip
    failed = [r["scenario"] for r in data if not r["ok"]]
    verdict = "**met**" if not failed else "**NOT met** (" + "; ".join(failed) + ")"
    return f"""## Goal

- Every scenario ends as expected: {verdict}, {len(ok)} of {len(data)}.

## Scenarios

*Seconds*: for the rank faults, from the fault until the last survivor raised; otherwise the whole run, process
start and imports included.

{table(["scenario", "expected", "observed", "seconds", "as expected"], rows)}

A frozen rank is caught by the process groups' `timeout` (the strategy's argument; the scenario names the value
used), a dead one by the broken connection. A wrong job shape is refused by every rank before any process group
exists; a YAML value out of range is refused when the file is parsed, with the key named. The gloo messages' build
paths are left out here; the JSON keeps them."""  # fmt: skip
