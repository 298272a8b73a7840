"""The errors sparsecc raises on purpose.

Every one derives from :class:`SparseccError`, so ``except sparsecc.SparseccError`` catches
all of them; each subclass names what went wrong and carries what a user needs to fix it.
"""
from __future__ import annotations


class SparseccError(Exception):
    """Base class of every error sparsecc raises deliberately."""


class InputError(SparseccError, ValueError):
    """An argument is malformed: example inputs that do not fit the model, a bad option."""


class TraceError(SparseccError):
    """No part of the model could be captured as a graph."""


class FormatError(SparseccError, ValueError):
    """A weight does not fit the format asked for, or a format name does not parse."""


class PatternError(SparseccError, ValueError):
    """A pruning pattern does not parse or cannot be applied to a weight."""


class PlanError(SparseccError):
    """A plan does not match the model it is applied to."""


class KernelBuildError(SparseccError):
    """A generated kernel failed to compile.

    Attributes:
        command: the compiler command line, as a list of arguments.
        stderr: what the compiler printed.
        source_path: where the rendered source was written, to read or rebuild by hand.
    """

    def __init__(self, message: str, *, command: list[str] | None = None,
                 stderr: str = "", source_path: str | None = None):
        self.command = list(command or [])
        self.stderr = stderr
        self.source_path = source_path
        details = [message]
        if self.command:
            details.append("command: " + " ".join(self.command))
        if source_path:
            details.append(f"source: {source_path}")
        if stderr:
            tail = stderr.strip().splitlines()[-30:]
            details.append("stderr (last lines):\n" + "\n".join(tail))
        super().__init__("\n".join(details))
