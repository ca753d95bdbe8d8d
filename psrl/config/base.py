"""The base of every config section: strict, typed, and complete with defaults."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config sub-tree. Unknown keys are errors; values are checked on load and on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
