"""The trainer sidecar: one process per job per node, driven by the node daemon.

What the node daemon and the sidecar agree on besides the ``Reconfigure`` order
stream lives here, so that the daemon need not import the sidecar itself.
"""

from __future__ import annotations

import msgspec

SPARE_JOB = "-"
"""``--job -``: a spare sidecar, started ahead of need, that learns its job from its
first stdin line (see ``shoal_services.trainer_sidecar.__main__``)."""


class Adoption(msgspec.Struct, forbid_unknown_fields=True):
    """The first stdin line of a spare sidecar: the job it now runs."""

    job_id: str


def adoption_line(job_id: str) -> bytes:
    """The line that hands ``job_id`` to a spare sidecar."""
    return msgspec.json.encode(Adoption(job_id=job_id)) + b"\n"
