"""Command-line options derived from the wire types, so the client's ``batchgen submit`` and the server's
``batchgen-server run-batch`` take the batch-level defaults with the same names, checks and help."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from .batches import GenerationDefaults


def add_generation_defaults(parser: argparse.ArgumentParser) -> None:
    """One option per ``GenerationDefaults`` field, checked against the field's own type and bounds."""
    group = parser.add_argument_group("batch-level defaults", "for the requests that do not set their own value")
    hints = typing.get_type_hints(GenerationDefaults, include_extras=True)
    struct = msgspec.inspect.type_info(GenerationDefaults)
    assert isinstance(struct, msgspec.inspect.StructType)
    for field in struct.fields:
        assert isinstance(field.type, msgspec.inspect.UnionType)  # Annotated[int | float | Struct, Meta(...)] | None
        (meta,) = (kind for kind in field.type.types if isinstance(kind, msgspec.inspect.Metadata))
        is_json = isinstance(meta.type, msgspec.inspect.StructType)
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            type=_checked(hints[field.name], is_json),
            metavar="JSON" if is_json else "N" if isinstance(meta.type, msgspec.inspect.IntType) else "X",
            help=(meta.extra_json_schema or {}).get("description"),
        )


def _checked(hint: Any, is_json: bool) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            if is_json:
                return msgspec.json.decode(text, type=hint)
            return msgspec.convert(text, hint, strict=False)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    return convert
