"""The `check` node as one record (`CheckSettings`): how many real sessions `job=check` certifies.

It checks its own key as it is made. What the check does with it is `certify/check.py`'s (and the `check`
recipe's, `recipes/check.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckSettings:
    """The `check` node; connects `job=check`'s command line to the certificate (`relax_pipeline/certify/`)."""

    sessions: int = 4
    """Sessions of the configured agent run through the configured engine and examined turn by turn (template
    round trip, forks, parsers, export, runtime); 0 checks the config only."""

    def __post_init__(self) -> None:
        if self.sessions < 0:
            raise ValueError(f"check.sessions={self.sessions} must be 0 (the config only) or more")
