"""Deprecated: the planner is :mod:`lightning_zeropp.planner` (``python -m lightning_zeropp.planner``), and its
function ``plan`` is :func:`~lightning_zeropp.prediction.predict`. "Plan" names one thing in this package, the
:class:`~lightning_zeropp.commplan.CommPlan`.

Importing this module, or running ``python -m lightning_zeropp.plan``, warns and forwards to the planner (and to
:mod:`~lightning_zeropp.prediction` and :mod:`~lightning_zeropp.recommendation`, the modules the planner was split
into), so that scripts written for the old name keep working until it is removed.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from . import planner, prediction, recommendation

MOVED = (
    "lightning_zeropp.plan is now lightning_zeropp.planner: run `python -m lightning_zeropp.planner`; import the model"
    " from lightning_zeropp.prediction (the function `plan` is `predict` there) and the verdict from"
    " lightning_zeropp.recommendation; the old name will be removed."
)

warnings.warn(MOVED, FutureWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    """Every name of the planner and of the two modules split out of it, and ``plan``, its function's old name."""
    if name == "plan":
        return prediction.predict
    for module in (planner, prediction, recommendation):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    planner.main(sys.argv[1:])
