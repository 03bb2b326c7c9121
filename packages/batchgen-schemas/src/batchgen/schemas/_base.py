"""Shared Struct bases. msgspec applies `kw_only` per class, so every subclass repeats it."""

from __future__ import annotations

import msgspec


class Wire(msgspec.Struct, kw_only=True, omit_defaults=False):
    """Base of every object the server sends: all fields always present, ``None`` encoded as ``null``."""


class Body(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """Base of request bodies users send: unknown fields are ignored, unset fields stay unset on re-encode.

    Plain data never forms reference cycles, so instances skip GC tracking (validating big files is faster).
    """
