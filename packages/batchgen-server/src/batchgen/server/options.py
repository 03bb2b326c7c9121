"""Settings declared once: a dataclass field made with :func:`setting` is a command-line flag, a ``BATCHGEN_*``
environment variable, a default and a help text at the same time (the server's ``Settings`` and the engine's
``EngineConfig`` are declared this way).

A value comes from the flag when it is given, else from the environment variable, else from the default. The flag is
the field's name in kebab case (``max_num_seqs`` is ``--max-num-seqs``) unless the declaration names others; the
variable is ``BATCHGEN_`` and the name in capitals. Types follow the annotation: ``bool`` is a pair of flags
(``--insecure`` / ``--no-insecure``) and ``1/true/yes/on`` or ``0/false/no/off`` in the environment, ``tuple[str,
...]`` a flag taking several values (``--served-model-name a b``, or repeated) and a comma-separated variable,
``X | None`` an optional ``X``.

This module imports nothing heavy, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "BATCHGEN_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}

T = TypeVar("T")


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    flags: tuple[str, ...] = (),
) -> Any:
    """A dataclass field that is also a flag and an environment variable (see the module's docstring)."""
    metadata = {"help": help, "flags": flags}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True, slots=True)
class _Option:
    name: str
    kind: type
    """The value's type: ``bool``, ``int``, ``float``, ``str``, ``Path`` or ``tuple`` (of strings)."""
    optional: bool
    help: str
    flags: tuple[str, ...]
    default: Any

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def parse(self, raw: str) -> Any:
        """A value from its text (an environment variable, or a flag's argument)."""
        if self.kind is tuple:
            return tuple(item.strip() for item in raw.split(",") if item.strip())
        if self.optional and raw.strip() == "":
            return None
        if self.kind is bool:
            value = raw.strip().lower()
            if value not in _TRUE | _FALSE:
                raise ValueError(f"{self.env}={raw!r}: use 1/true/yes/on or 0/false/no/off")
            return value in _TRUE
        try:
            return self.kind(raw)
        except ValueError:
            raise ValueError(f"{self.env}={raw!r}: not a valid {self.kind.__name__}") from None

    def shown_default(self) -> str:
        """``"default: X; "`` for the help text, or nothing where the help says what an unset value means."""
        if self.default in (None, "", ()):
            return ""
        if self.kind is bool:
            return f"default: {'on' if self.default else 'off'}; "
        return f"default: {','.join(self.default) if self.kind is tuple else self.default}; "

    def argument(self, raw: str) -> Any:
        """``parse`` for argparse, which reports an ``ArgumentTypeError`` next to the flag."""
        try:
            return self.parse(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a valid {self.kind.__name__}: {raw!r}") from None


def options(cls: type) -> list[_Option]:
    """The declared settings of a dataclass, in declaration order (fields not made with ``setting`` are skipped)."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        kind, optional = _kind(hints[f.name])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        flags = f.metadata["flags"] or (f"--{f.name.replace('_', '-')}",)
        found.append(_Option(f.name, kind, optional, f.metadata["help"], flags, default))
    return found


def _kind(annotation: Any) -> tuple[type, bool]:
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (inner,) = (arg for arg in args if arg is not type(None))
        return _kind(inner)[0], True
    if typing.get_origin(annotation) is tuple:
        return tuple, False
    if annotation in (bool, int, float, str, Path):
        return annotation, False
    raise TypeError(f"a setting cannot have the type {annotation!r}")


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One flag per declared setting of ``cls``, in a group titled ``title``; an unset flag stays ``None``."""
    group = parser.add_argument_group(title)
    for option in options(cls):
        text = f"{option.help} [{option.shown_default()}env {option.env}]".replace("%", "%%")
        if option.kind is bool:
            group.add_argument(*option.flags, dest=option.name, action=argparse.BooleanOptionalAction, help=text)
        elif option.kind is tuple:
            # vLLM's way: several values after one flag (``--served-model-name a b``), or the flag repeated
            group.add_argument(*option.flags, dest=option.name, action="extend", nargs="+", metavar="VALUE", help=text)
        else:
            metavar = "TEXT" if option.kind is str else option.kind.__name__.upper()
            group.add_argument(*option.flags, dest=option.name, type=option.argument, metavar=metavar, help=text)
        parser.set_defaults(**{option.name: None})


def build(
    cls: type[T], args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None, **extra: Any
) -> T:
    """``cls`` from its flags in ``args`` (those given), else ``environ`` (default: ``os.environ``), else defaults;
    ``extra`` sets fields that are not settings (a nested config)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for option in options(cls):
        given = None if args is None else getattr(args, option.name, None)
        if given is not None:
            values[option.name] = tuple(given) if option.kind is tuple else given
        elif option.env in environ:
            values[option.name] = option.parse(environ[option.env])
    return cls(**values, **extra)
