"""One exception base for every failure hpct reports to a user.

Each class owns a distinct exit code so that scripts (and CI) can tell a bad
input from a broken toolchain without parsing text.  Every message is meant to
be shown as is: it names the problem and what to do next.  Tracebacks are shown
only with ``-v``.
"""

from __future__ import annotations


class HpctError(Exception):
    """Base class: ``str(err)`` is the whole user-facing message."""

    exit_code = 1

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.problem = message
        self.fix = fix
        super().__init__(message if not fix else f"{message}\n  fix: {fix}")


class ConfigError(HpctError):
    """An environment variable or option has a bad value or an unknown name."""

    exit_code = 2


class SourceError(HpctError):
    """A source archive or tree is missing, unreachable or not the pinned one."""

    exit_code = 3


class ChecksumError(SourceError):
    """An archive's sha256 differs from the pin (the archive has been deleted)."""

    exit_code = 4


class PatchError(HpctError):
    """A series names a missing patch, or a hunk does not apply."""

    exit_code = 5


class ToolchainError(HpctError):
    """cmake, ninja, a compiler or another required program is missing."""

    exit_code = 6


class BuildError(HpctError):
    """A build step failed; the message names its log file."""

    exit_code = 7


class SysctlError(HpctError):
    """A kernel setting could not be read, written or verified."""

    exit_code = 8


class PortPlanError(HpctError):
    """The port plan does not fit the kernel's ranges or the group count."""

    exit_code = 9


class DoctorFailed(HpctError):
    """``hpct doctor`` found at least one required check failing."""

    exit_code = 10


class RendezvousError(HpctError):
    """Peers could not be reached before the connect deadline."""

    exit_code = 11


EXIT_CODES = {cls.__name__: cls.exit_code for cls in (
    HpctError, ConfigError, SourceError, ChecksumError, PatchError, ToolchainError,
    BuildError, SysctlError, PortPlanError, DoctorFailed, RendezvousError)}
