"""Installed versions of the dependencies, and the one way a missing feature is reported."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def parse(text: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; pre-release and local parts are ignored."""
    numbers = []
    for part in text.split("+")[0].split("."):
        digits = part[: len(part) - len(part.lstrip("0123456789"))]
        if not digits:
            break
        numbers.append(int(digits))
        if digits != part:  # "0rc1", "0a0": the number, then stop
            break
    return tuple(numbers)


def installed(package: str) -> tuple[int, ...] | None:
    try:
        return parse(version(package))
    except PackageNotFoundError:
        return None


TORCH_VERSION = installed("torch") or ()
LIGHTNING_VERSION = installed("lightning") or ()
TRITON_VERSION = installed("triton")  # None where triton is not installed (it is Linux x86-64 only)


def require(ok: bool, package: str, feature: str) -> None:
    """Raises ImportError naming the package, its installed version and what needs a newer one."""
    if not ok:
        have = {"torch": TORCH_VERSION, "lightning": LIGHTNING_VERSION, "triton": TRITON_VERSION}.get(package)
        shown = ".".join(map(str, have)) if have else "not installed"
        raise ImportError(
            f"lightning-zeropp needs a newer {package} for {feature} (installed: {shown}); see pyproject.toml for the"
            " supported versions."
        )
