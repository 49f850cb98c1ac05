"""Identifiers: ULIDs for events, and the token rule for ids that appear in NATS subjects."""

from __future__ import annotations

import os
import re
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"

# An id that is embedded in a subject must be a single NATS token: no dots, wildcards or spaces.
# ``$`` also matches before a final newline; ``(?!\n)`` refuses an id that ends with one.
SUBJECT_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$(?!\n)")


def new_ulid(now_s: float | None = None) -> str:
    """Return a 26-character ULID: 48 bits of milliseconds then 80 random bits, Crockford base32.

    ULIDs sort by creation time, which keeps `Nats-Msg-Id` values readable in logs.
    """
    ms = int((time.time() if now_s is None else now_s) * 1000) & ((1 << 48) - 1)
    value = (ms << 80) | int.from_bytes(os.urandom(10), "big")
    out = []
    for _ in range(26):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


def is_subject_token(value: str) -> bool:
    """True when `value` can stand as one token of a NATS subject."""
    return bool(SUBJECT_TOKEN_RE.match(value))
