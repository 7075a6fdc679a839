"""The front doors' signatures and ``Arguments:`` docstrings, generated from the config.

Both strategies (the Trainer's :class:`lightning_zeropp.ZeroPPStrategy` and Fabric's
:class:`lightning_zeropp.fabric.ZeroPPStrategy`) take, in this order: the fields of
:class:`~lightning_zeropp.config.ZeroPPConfig` with their types and defaults, then the front door's own arguments
(Fabric's ``parallelize_fn``), keyword only. The deprecated spellings of :data:`~lightning_zeropp.config.RENAMED` are
still taken by name, with a warning, but are not part of the signature (nor of LightningCLI's help). LightningCLI
(jsonargparse) reads that signature (``inspect.signature``) and the generated docstring, so each argument is typed and
documented there as in Python. The docs' table of arguments comes from the same fields
(:mod:`lightning_zeropp.argument_table`).
"""

from __future__ import annotations

import inspect
import textwrap
import typing
from dataclasses import Field, fields, is_dataclass
from typing import Any

from .config import RENAMED, ZeroPPConfig, doc, when

_WIDTH = 116  # a docstring line, once indented by four in the source, stays within 120 columns


def parameters(config_class: type[ZeroPPConfig], own: type | None = None) -> list[inspect.Parameter]:
    """The strategy's parameters (without ``self``), annotated with the evaluated types of the fields."""

    def of(dataclass: type, kind: Any) -> list[inspect.Parameter]:
        hints = typing.get_type_hints(dataclass)
        return [inspect.Parameter(f.name, kind, default=f.default, annotation=hints[f.name]) for f in fields(dataclass)]

    params = of(config_class, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return params + (of(own, inspect.Parameter.KEYWORD_ONLY) if own is not None else [])


def signature(config_class: type[ZeroPPConfig], own: type | None = None) -> inspect.Signature:
    """The signature of a strategy's ``__init__``: ``self``, then :func:`parameters`."""
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Signature([this, *parameters(config_class, own)], return_annotation=None)


def _entries(config_class: type[ZeroPPConfig], own: type | None) -> list[tuple[str, str]]:
    def text(f: Field) -> str:
        return f"{doc(f)} Change it: {when(f)}" if when(f) else doc(f)

    entries = [(f.name, text(f)) for f in fields(config_class)]
    entries += [(f.name, text(f)) for f in fields(own)] if own is not None else []
    return entries


def docstring(intro: str, config_class: type[ZeroPPConfig], own: type | None = None) -> str:
    """``intro`` followed by the ``Arguments:`` section (Google style, as jsonargparse reads it) of every argument."""
    lines = [inspect.cleandoc(intro), "", "Arguments:"]
    for name, text in _entries(config_class, own):
        lines += textwrap.wrap(
            f"{name}: {text}", _WIDTH, initial_indent="    ", subsequent_indent="        ", break_on_hyphens=False
        )
    return "\n".join(lines) + "\n"


def declare(cls: type, config_class: type[ZeroPPConfig], own: type | None) -> None:
    """Gives a strategy class the arguments of ``config_class`` (and its own, ``own``): its ``__init__``'s signature
    and its docstring. An inherited ``__init__`` is wrapped first, so that the base class keeps its own."""
    if not (isinstance(config_class, type) and issubclass(config_class, ZeroPPConfig)):
        raise TypeError(f"{cls.__name__}: `config` must be ZeroPPConfig or a dataclass derived from it.")
    if own is not None and not is_dataclass(own):
        raise TypeError(f"{cls.__name__}: a front door's own arguments are a dataclass of `argument(...)` fields.")
    intro = cls.__dict__.get("__doc__") or getattr(cls, "arguments_intro", "")
    if "__init__" not in cls.__dict__:
        inherited = cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            inherited(self, *args, **kwargs)

        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        cls.__init__ = __init__
    cls.config_class = config_class
    cls.own_arguments = own
    cls.arguments_intro = intro
    cls.arguments_signature = signature(config_class, own)
    cls.__init__.__signature__ = cls.arguments_signature
    cls.__doc__ = docstring(intro, config_class, own)


def bind(cls: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[ZeroPPConfig, dict[str, Any]]:
    """A strategy's arguments as its ``__init__`` received them: the validated config and the front door's own
    arguments (defaults filled in). An unknown or missing argument raises the ``TypeError`` Python would. The
    deprecated spellings (:data:`~lightning_zeropp.config.RENAMED`) are taken by name, outside the signature (so that
    neither the signature nor LightningCLI's help shows them), and mapped with a warning by the config."""
    kwargs = dict(kwargs)
    deprecated = {old: kwargs.pop(old) for old in RENAMED if old in kwargs}
    try:
        bound = cls.arguments_signature.bind(None, *args, **kwargs)
    except TypeError as err:
        raise TypeError(f"{cls.__name__}.__init__() {err}") from None
    given = dict(bound.arguments)
    given.pop("self")
    given.update(deprecated)
    own = {f.name: given.pop(f.name, f.default) for f in fields(cls.own_arguments)} if cls.own_arguments else {}
    return cls.config_class.from_arguments(given), own
