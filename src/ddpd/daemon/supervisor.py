"""Moved to `attempt` (kept until the scheduler imports from there)."""

from .attempt import Attempt, Outcome

__all__ = ["Attempt", "Outcome"]
