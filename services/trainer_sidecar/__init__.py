"""The trainer sidecar: one process per job per node, driven by the node daemon.

What the node daemon and the sidecar agree on besides the ``Reconfigure`` order
stream lives here, so that the daemon need not import the sidecar itself.
"""

from __future__ import annotations

import msgspec

SPARE_JOB = "-"
"""``--job -``: a spare sidecar, started ahead of need, that learns its job from its
first stdin line (see ``shoal_services.trainer_sidecar.__main__``)."""


SIDECAR_TOKEN = "SHOAL_SIDECAR_TOKEN"
"""The environment variable that gives a sidecar started for one job its token
(:mod:`shoal.callout`); a spare gets its token in its :class:`Adoption` line."""


class Adoption(msgspec.Struct, forbid_unknown_fields=True):
    """The first stdin line of a spare sidecar: the job it now runs and, when the node
    daemon mints sidecar tokens (``SHOAL_SIDECAR_TOKENS``), the token it connects with."""

    job_id: str
    token: str = ""


def adoption_line(job_id: str, token: str = "") -> bytes:
    """The line that hands ``job_id`` (and its sidecar token) to a spare sidecar."""
    return msgspec.json.encode(Adoption(job_id=job_id, token=token)) + b"\n"
