"""Deprecated: the planner is :mod:`lightning_zeropp.planner` (``python -m lightning_zeropp.planner``), and its
function ``plan`` is :func:`~lightning_zeropp.planner.predict`. "Plan" names one thing in this package, the
:class:`~lightning_zeropp.commplan.CommPlan`.

Importing this module, or running ``python -m lightning_zeropp.plan``, warns and forwards to the planner, so that
scripts written for the old name keep working until it is removed.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from . import planner

MOVED = (
    "lightning_zeropp.plan is now lightning_zeropp.planner: run `python -m lightning_zeropp.planner` and import from"
    " lightning_zeropp.planner (its function `plan` is `predict`); the old name will be removed."
)

warnings.warn(MOVED, FutureWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """Every name of the planner, and ``plan``, its function's old name."""
    return planner.predict if name == "plan" else getattr(planner, name)


if __name__ == "__main__":
    planner.main(sys.argv[1:])
