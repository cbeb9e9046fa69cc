"""One exception hierarchy for every failure hpct reports: the CLIs', the backend's, Gloo's.

Each class owns a distinct exit code so that scripts (and CI) can tell a bad
input from a broken toolchain, or a lost peer from a bad argument, without parsing
text.  Every message is meant to be shown as is: it names the problem and what to do
next.  Tracebacks are shown only with ``-v``.

The root is a ``RuntimeError`` because a failed collective must be one: torch's own
backends raise RuntimeError, and training code (DDP, FSDP, torchrun's agents) catches
that.  The runtime branch:

- ``CollectiveError``: an op of an hpct group failed (peer lost, aborted, timed out);
  the group is failed and ``hpct.distributed.recover()`` re-forms it.
- ``HpctArgumentError``: a collective was called with arguments the backend refuses;
  nothing was sent and the group is fine (also a ``ValueError``).
- ``TransportError``: the base of the ``hpct._gloo`` extension's exception types
  (GlooError and its subclasses: AbortedError, PeerError, OpTimeoutError, ...), which
  the extension creates at import with this class as their root.
"""

from __future__ import annotations


class HpctError(RuntimeError):
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


class FormationError(RendezvousError):
    """A group's connect failed before its deadline, before the group formed: a peer died or gave
    the generation up.  Nobody is missing for good: the next membership forms without it."""

    exit_code = 19


class CollectiveError(HpctError):
    """An op of an hpct process group failed: the message names the group, the rank, the
    generation and (where known) the peer; the group is failed until ``recover()``."""

    exit_code = 12


class HpctArgumentError(HpctError, ValueError):
    """A collective was called with arguments the hpct backend refuses; nothing was sent."""

    exit_code = 13


class ParityError(HpctError):
    """Members' shared training state differs and cannot be repaired from a majority
    (``hpct.distributed.sync_state``): the message names the tensor and each version's ranks."""

    exit_code = 15


class SuspectFound(HpctError):
    """``hpct diagnose`` found a suspect link or node, or a setting that differs across ranks."""

    exit_code = 16


class DiagnoseTimeout(HpctError):
    """``hpct diagnose`` ran past its ``--timeout``: the message names the link it was measuring."""

    exit_code = 17


class LaunchError(HpctError):
    """``hpct run`` refused its input (a flag, the host list, a peer agent of another job) or
    ended the job (a worker out of restarts, a worker that cannot start, a scheduler's cancel)."""

    exit_code = 18


class TransportError(HpctError):
    """Root of the transport's own errors (``hpct._gloo.GlooError`` and its subclasses)."""

    exit_code = 14


def _all(cls: type) -> list[type]:
    return [cls] + [sub for child in cls.__subclasses__() for sub in _all(child)]


# Every class above, by name; a subclass made elsewhere (the extension's) is not listed.
EXIT_CODES = {cls.__name__: cls.exit_code for cls in _all(HpctError) if cls.__module__ == __name__}
