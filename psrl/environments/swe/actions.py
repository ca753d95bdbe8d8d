"""What an agent can do in a SWE episode: run a bash command, or submit."""

from __future__ import annotations

import re
from dataclasses import dataclass

# mini-swe-agent's convention: a command whose output starts with this line ends the episode.
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

_BLOCK = re.compile(r"```(?:bash|sh|shell|mswea_bash_command)[ \t]*\n(.*?)\n?```", re.DOTALL)


@dataclass(frozen=True)
class BashAction:
    command: str


@dataclass(frozen=True)
class Submit:
    """End the episode now and grade the workspace as it is."""


@dataclass(frozen=True)
class FormatError:
    """A model turn without exactly one command; the environment answers with ``message``."""

    text: str
    message: str


SWEAction = BashAction | Submit | FormatError


def parse_action(text: str) -> BashAction | FormatError:
    """Exactly one fenced ``bash`` (or ``sh``, ``mswea_bash_command``) block."""
    blocks = [b.strip() for b in _BLOCK.findall(text)]
    if len(blocks) != 1 or not blocks[0]:
        return FormatError(
            text,
            f"Format error: expected exactly one command in a ```bash block, found {len(blocks)}. "
            f"To finish, run `echo {SUBMIT_MARKER}` on its own.",
        )
    return BashAction(blocks[0])


def is_submission(output: str, exit_code: int | None) -> bool:
    lines = output.lstrip().splitlines()
    return exit_code == 0 and bool(lines) and lines[0].strip() == SUBMIT_MARKER
