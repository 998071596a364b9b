"""The mistakes a user can act on, at the bottom of the package: every layer raises them, the
stage wrapper (``draftline.pipeline.stage``) and the Make tools print them in two lines
(``refuse``), and nothing here imports the rest of draftline."""

from __future__ import annotations

import sys
from typing import NoReturn


class UserError(Exception):
    """A failure the user can act on from its message and hint alone: what they gave (a config,
    a model directory, data) is not usable, or the run's own check (the gate) said no. A stage
    prints the two lines and keeps the traceback in its log file (stage.run_stage); the config
    entry points print the two lines (``refuse``). Exit code 2, as for Make's usage errors."""

    hint_text: str | None = None  # the class's hint, when the raise gives none

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint or self.hint_text


class UserConfigError(UserError, ValueError):
    """A mistake in what the user asked for (a key, an experiment, a path, a required value left
    unset), refused before any stage starts."""


def refuse(error: Exception, one_line: bool = False) -> NoReturn:
    """Print a user's mistake and exit 2: message and hint on stderr, or both on one stdout line
    for Make's parse-time `$(shell ...)` (its `$(error ...)` shows that line and stops)."""
    hint = getattr(error, "hint", None)
    if one_line:
        print(f"draftline: {error}" + (f"; hint: {hint}" if hint else ""))
    else:
        print(f"draftline: {error}" + (f"\nhint: {hint}" if hint else ""), file=sys.stderr)
    sys.exit(2)


class DataError(UserError, ValueError):
    """Input data is unusable; the message names the file and line / item / sample."""

    hint_text = ("data.path holds ShareGPT (conversations: from/value) or OpenAI (messages: "
                 "role/content) records in JSON, JSONL, parquet or a datasets directory; data.field "
                 "and data.roles adapt others (README.md, 'Your own conversations')")
