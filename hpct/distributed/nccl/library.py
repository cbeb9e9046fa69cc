"""NCCL from Python through ctypes: the CUDA half of the ``hpct`` backend links neither torch nor CUDA.

Which libnccl is used is nccl_find.py's (``load()``).  A library other than torch's is opened with ``RTLD_LOCAL | RTLD_DEEPBIND``: its symbols never
become global (torch keeps calling its own NCCL) and it binds its own exported functions to
itself even when torch's copy sits in the global scope.  ``dlmopen(LM_ID_NEWLM)`` is NOT used:
a new link-map namespace would load a second libcuda (its own contexts and streams), and the
streams torch hands us would mean nothing to it.

Errors: every ncclResult_t other than ncclSuccess raises an ``NcclError`` subclass (all are
``hpct.errors.TransportError``) whose message carries ncclGetErrorString and, where a
communicator is known, ncclGetLastError.  A library that cannot be used raises
``NcclLibraryError``; a stock library asked for the rootless call raises
``NcclRootlessMissingError`` naming the fix.  A dtype or reduce op NCCL cannot take raises
``hpct.errors.HpctArgumentError``.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

from ...config import NCCL_LIBRARY_VAR
from ...errors import HpctArgumentError, TransportError

LIBRARY_VAR = NCCL_LIBRARY_VAR
ROOTLESS_SYMBOL = "ncclCommInitRankRootless"
ROOTLESS_ID_SYMBOL = "ncclRootlessUniqueId"
REVOKE_SYMBOL = "ncclCommRevoke"
# hpct's NCCL patch (0004 on 2.30.7, 0003 on 2.21.5): raise a comm's abort flags alone, so that a
# call NCCL holds returns before ncclCommAbort runs under the comm's lock (NCCL's abort contract).
RAISE_ABORT_SYMBOL = "ncclCommRaiseAbortFlag"
ROOTLESS_FIX = ("install hpct's nvidia-nccl wheel (hpct-build wheel nccl) or set HPCT_NCCL_LIBRARY "
                "to a patched libnccl.so.2")

_OURS: set[str] = set()     # realpaths hpct opened itself (not torch's); nccl_find.py reads it

RTLD_NOW = 0x2
RTLD_LOCAL = 0x0
RTLD_DEEPBIND = 0x8
RTLD_NOLOAD = 0x4

# ncclConfig_t as NCCL 2.21.5 lays it out (ncclConfig_v21700).  Later versions only append
# fields and copy min(size, their sizeof) bytes, then default every field newer than
# ``version``, so this prefix is read correctly by 2.21 through 2.30.
CONFIG_MAGIC = 0xCAFEBEEF
CONFIG_VERSION = 22105
CONFIG_UNDEF_INT = -(2 ** 31)


# ---------------------------------------------------------------------------- errors
class NcclError(TransportError):
    """A call into libnccl returned an error (``code`` is the ncclResult_t)."""

    code = -1
    result_name = "ncclError"

    def __init__(self, message: str, *, code: int | None = None, fix: str | None = None) -> None:
        if code is not None:
            self.code = code
        super().__init__(message, fix=fix)


class NcclUnhandledCudaError(NcclError):
    code, result_name = 1, "ncclUnhandledCudaError"


class NcclSystemError(NcclError):
    code, result_name = 2, "ncclSystemError"


class NcclInternalError(NcclError):
    code, result_name = 3, "ncclInternalError"


class NcclInvalidArgumentError(NcclError):
    code, result_name = 4, "ncclInvalidArgument"


class NcclInvalidUsageError(NcclError):
    code, result_name = 5, "ncclInvalidUsage"


class NcclRemoteError(NcclError):
    code, result_name = 6, "ncclRemoteError"


class NcclInProgressError(NcclError):
    code, result_name = 7, "ncclInProgress"


class NcclTimeoutError(NcclError):
    code, result_name = 8, "ncclTimeout"


RESULT_ERRORS: dict[int, type[NcclError]] = {
    cls.code: cls for cls in (NcclUnhandledCudaError, NcclSystemError, NcclInternalError,
                              NcclInvalidArgumentError, NcclInvalidUsageError, NcclRemoteError,
                              NcclInProgressError, NcclTimeoutError)}
SUCCESS, INVALID_ARGUMENT, IN_PROGRESS = 0, 4, 7


class NcclLibraryError(TransportError):
    """No usable libnccl: missing file, not a shared library, or a required symbol absent."""


class NcclRootlessMissingError(NcclLibraryError):
    """The libnccl has no ``ncclCommInitRankRootless`` (NVIDIA's stock build)."""


class NoCudaDeviceError(NcclLibraryError):
    """A CUDA op was asked of a process that sees no CUDA device."""


# ---------------------------------------------------------------------------- types
class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class RootlessInfo(ctypes.Structure):
    """ncclRootlessInfo_t (nccl_rootless.h, NCCL_ROOTLESS_API_VERSION 1)."""

    _fields_ = [("size", ctypes.c_size_t), ("listenAddr", ctypes.c_char_p),
                ("nextAddr", ctypes.c_char_p), ("jobKey", ctypes.c_uint64),
                ("generation", ctypes.c_uint32), ("groupIndex", ctypes.c_uint32),
                ("connectTimeoutMs", ctypes.c_int), ("retryDelayMs", ctypes.c_int)]


class Config(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int),
                ("minCTAs", ctypes.c_int), ("maxCTAs", ctypes.c_int),
                ("netName", ctypes.c_char_p), ("splitShare", ctypes.c_int)]


def make_config(blocking: bool) -> Config:
    return Config(ctypes.sizeof(Config), CONFIG_MAGIC, CONFIG_VERSION, 1 if blocking else 0,
                  CONFIG_UNDEF_INT, CONFIG_UNDEF_INT, CONFIG_UNDEF_INT, None, CONFIG_UNDEF_INT)


@dataclass(frozen=True)
class RootlessSpec:
    """What one rank passes to ncclCommInitRankRootless for one communicator."""

    listen_addr: str
    next_addr: str
    job_key: int
    generation: int
    group_index: int
    connect_timeout_ms: int
    retry_delay_ms: int = 100

    def info(self) -> RootlessInfo:
        for name in ("listen_addr", "next_addr"):
            value = getattr(self, name)
            if not value or ":" not in value:
                raise HpctArgumentError(f"rootless NCCL: {name}={value!r} is not a host:port address",
                                    fix="give 'host:port' or '[v6]:port' from the port plan")
        if not 0 <= self.job_key < 2 ** 64:
            raise HpctArgumentError(f"rootless NCCL: job key {self.job_key} does not fit 64 bits",
                                fix="derive it with hpct.distributed.nccl.plan.job_key()")
        for name in ("generation", "group_index"):
            if not 0 <= getattr(self, name) < 2 ** 32:
                raise HpctArgumentError(f"rootless NCCL: {name}={getattr(self, name)} does not fit 32 bits",
                                    fix="pass a non-negative 32-bit value")
        ms = max(1, min(int(self.connect_timeout_ms), 2 ** 31 - 1))
        return RootlessInfo(ctypes.sizeof(RootlessInfo), self.listen_addr.encode(),
                            self.next_addr.encode(), self.job_key, self.generation, self.group_index,
                            ms, int(self.retry_delay_ms))


c_comm = ctypes.c_void_p
c_stream = ctypes.c_void_p
_P = ctypes.c_void_p
_S = ctypes.c_size_t
_I = ctypes.c_int

# name -> (restype, argtypes, required).  ncclResult_t is an int.
FUNCTIONS: dict[str, tuple] = {
    "ncclGetVersion": (_I, [ctypes.POINTER(_I)], True),
    "ncclGetErrorString": (ctypes.c_char_p, [_I], True),
    "ncclGetLastError": (ctypes.c_char_p, [c_comm], False),
    "ncclGetUniqueId": (_I, [ctypes.POINTER(UniqueId)], True),
    "ncclCommInitRankConfig": (_I, [ctypes.POINTER(c_comm), _I, UniqueId, _I, ctypes.POINTER(Config)], True),
    ROOTLESS_SYMBOL: (_I, [ctypes.POINTER(c_comm), _I, _I, ctypes.POINTER(RootlessInfo),
                           ctypes.POINTER(Config)], False),
    ROOTLESS_ID_SYMBOL: (_I, [ctypes.POINTER(RootlessInfo), _I, ctypes.POINTER(UniqueId)], False),
    "ncclCommDestroy": (_I, [c_comm], True),
    "ncclCommAbort": (_I, [c_comm], True),
    "ncclCommFinalize": (_I, [c_comm], False),
    REVOKE_SYMBOL: (_I, [c_comm, _I], False),
    RAISE_ABORT_SYMBOL: (_I, [c_comm], False),
    "ncclCommGetAsyncError": (_I, [c_comm, ctypes.POINTER(_I)], True),
    "ncclCommCount": (_I, [c_comm, ctypes.POINTER(_I)], True),
    "ncclCommCuDevice": (_I, [c_comm, ctypes.POINTER(_I)], True),
    "ncclCommUserRank": (_I, [c_comm, ctypes.POINTER(_I)], True),
    "ncclGroupStart": (_I, [], True),
    "ncclGroupEnd": (_I, [], True),
    "ncclAllReduce": (_I, [_P, _P, _S, _I, _I, c_comm, c_stream], True),
    "ncclBroadcast": (_I, [_P, _P, _S, _I, _I, c_comm, c_stream], True),
    "ncclReduce": (_I, [_P, _P, _S, _I, _I, _I, c_comm, c_stream], True),
    "ncclAllGather": (_I, [_P, _P, _S, _I, c_comm, c_stream], True),
    "ncclReduceScatter": (_I, [_P, _P, _S, _I, _I, c_comm, c_stream], True),
    "ncclSend": (_I, [_P, _S, _I, _I, c_comm, c_stream], True),
    "ncclRecv": (_I, [_P, _S, _I, _I, c_comm, c_stream], True),
}


def version_text(code: int) -> str:
    """NCCL >= 2.9 encodes major*10000 + minor*100 + patch (22105 -> 2.21.5)."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


BLOCKING, NONBLOCKING = "blocking", "non-blocking"


def comm_kind(lib, asked_blocking: bool) -> tuple[str, str]:
    """(kind, why) of the comms an engine forms with ``lib`` (doctor shows ``why``)."""
    if not asked_blocking:
        return NONBLOCKING, "HPCT_NCCL_BLOCKING=0"
    if lib.has_raise_abort:
        return BLOCKING, f"held calls are woken by {RAISE_ABORT_SYMBOL} before ncclCommAbort"
    return NONBLOCKING, (f"this libnccl lacks {RAISE_ABORT_SYMBOL}, so a held blocking call could not "
                         "be ended by NCCL's rules; install hpct's NCCL build for blocking comms")


# ---------------------------------------------------------------------------- the library
class NcclLibrary:
    """One opened libnccl with its function table."""

    def __init__(self, path: str, *, how: str = "given", shared_with_torch: bool = False) -> None:
        self.path = str(path)
        self.how = how
        self.shared_with_torch = shared_with_torch
        p = Path(self.path)
        if not p.exists():
            raise NcclLibraryError(f"libnccl {self.path} ({how}): no such file",
                                   fix=f"point {LIBRARY_VAR} at an existing libnccl.so.2, or unset it")
        mode = RTLD_NOW | RTLD_LOCAL | (0 if shared_with_torch else RTLD_DEEPBIND)
        try:
            self._dll = ctypes.CDLL(self.path, mode=mode)
        except OSError as err:
            raise NcclLibraryError(f"libnccl {self.path} ({how}) cannot be loaded: {err}",
                                   fix=f"point {LIBRARY_VAR} at a libnccl.so.2 built for this machine") from None
        if not shared_with_torch:
            _OURS.add(os.path.realpath(self.path))
        self._fn: dict[str, object] = {}
        missing = []
        for name, (restype, argtypes, required) in FUNCTIONS.items():
            try:
                fn = getattr(self._dll, name)
            except AttributeError:
                if required:
                    missing.append(name)
                continue
            fn.restype, fn.argtypes = restype, argtypes
            self._fn[name] = fn
        if missing:
            raise NcclLibraryError(f"{self.path} ({how}) is not a usable libnccl: it lacks "
                                   f"{', '.join(missing)}",
                                   fix=f"point {LIBRARY_VAR} at NCCL's libnccl.so.2 (2.21 or newer)")
        v = ctypes.c_int(0)
        rc = self._fn["ncclGetVersion"](ctypes.byref(v))
        if rc != SUCCESS:
            raise NcclLibraryError(f"{self.path} ({how}): ncclGetVersion returned error {rc}",
                                   fix="reinstall the library")
        self.version = v.value

    # ---- facts ---------------------------------------------------------------------------
    @property
    def version_text(self) -> str:
        return version_text(self.version)

    def has(self, name: str) -> bool:
        return name in self._fn

    @property
    def has_rootless(self) -> bool:
        return self.has(ROOTLESS_SYMBOL) and self.has(ROOTLESS_ID_SYMBOL)

    @property
    def has_revoke(self) -> bool:
        return self.has(REVOKE_SYMBOL)

    @property
    def has_raise_abort(self) -> bool:
        """hpct's ncclCommRaiseAbortFlag: blocking comms can then be aborted by NCCL's rules."""
        return self.has(RAISE_ABORT_SYMBOL)

    def require_rootless(self) -> None:
        if not self.has_rootless:
            raise NcclRootlessMissingError(
                f"this libnccl has no {ROOTLESS_SYMBOL}: {self.path} ({self.how}, NCCL {self.version_text})",
                fix=ROOTLESS_FIX)

    def __repr__(self) -> str:
        return (f"NcclLibrary({self.path!r}, NCCL {self.version_text}, "
                f"rootless={'yes' if self.has_rootless else 'no'}, how={self.how!r})")

    # ---- errors --------------------------------------------------------------------------
    def error_string(self, code: int) -> str:
        text = self._fn["ncclGetErrorString"](code)
        return text.decode(errors="replace") if text else f"error {code}"

    def last_error(self, comm=None) -> str:
        fn = self._fn.get("ncclGetLastError")
        if fn is None:
            return ""
        text = fn(comm)
        return text.decode(errors="replace") if text else ""

    def error(self, code: int, what: str, comm=None) -> NcclError:
        cls = RESULT_ERRORS.get(code, NcclError)
        last = self.last_error(comm)
        text = f"{what}: NCCL {self.error_string(code)} ({cls.result_name}, {code})"
        if last:
            text += f"; last error: {last.strip()}"
        return cls(text, code=code)

    def check(self, code: int, what: str, comm=None, *, allow_in_progress: bool = False) -> int:
        if code == SUCCESS or (allow_in_progress and code == IN_PROGRESS):
            return code
        raise self.error(code, what, comm)

    # ---- calls ---------------------------------------------------------------------------
    def call(self, name: str, *args):
        fn = self._fn.get(name)
        if fn is None:
            raise NcclLibraryError(f"{self.path} (NCCL {self.version_text}) has no {name}",
                                   fix=ROOTLESS_FIX if name in (ROOTLESS_SYMBOL, ROOTLESS_ID_SYMBOL)
                                   else "use NCCL 2.28 or newer for this call")
        return fn(*args)

    def rootless_unique_id(self, spec: RootlessSpec, nranks: int) -> bytes:
        self.require_rootless()
        info, uid = spec.info(), UniqueId()
        self.check(self.call(ROOTLESS_ID_SYMBOL, ctypes.byref(info), nranks, ctypes.byref(uid)),
                   "ncclRootlessUniqueId")
        # All 128 bytes: reading the c_char array field would stop at the first NUL byte.
        return ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid))

    def init_rootless(self, box, nranks: int, rank: int, spec: RootlessSpec, *, blocking: bool) -> int:
        """ncclCommInitRankRootless into ``box`` (a ``c_comm``); its result, never raised.

        NCCL sets ``*box`` before the init runs, so another thread can read the handle during a
        blocking init (to raise its abort flag); after a failure the comm stays allocated for
        the caller to abort (comm.py does)."""
        self.require_rootless()
        if not 0 <= rank < nranks:
            raise HpctArgumentError(f"rootless NCCL: rank {rank} is outside a communicator of {nranks}",
                                    fix="pass the group rank (0 <= rank < nranks)")
        info, config = spec.info(), make_config(blocking)
        return self.call(ROOTLESS_SYMBOL, ctypes.byref(box), nranks, rank, ctypes.byref(info), ctypes.byref(config))

    @staticmethod
    def init_what(rank: int, nranks: int, spec: RootlessSpec) -> str:
        return (f"ncclCommInitRankRootless(rank {rank} of {nranks}, listen {spec.listen_addr}, "
                f"next {spec.next_addr}, generation {spec.generation}, group {spec.group_index})")

    def comm_init_rootless(self, nranks: int, rank: int, spec: RootlessSpec, *, blocking: bool = False):
        """Start creating a rootless communicator on the current CUDA device (for callers
        outside the engine: the proof's bare comms, tests).  Returns (comm handle, result):
        with ``blocking=False`` the result may be ncclInProgress; poll ``async_error(comm)``.
        A failed init's comm is aborted here before the error is raised."""
        comm = c_comm()
        rc = self.init_rootless(comm, nranks, rank, spec, blocking=blocking)
        if rc not in (SUCCESS, IN_PROGRESS):
            err = self.error(rc, self.init_what(rank, nranks, spec), comm if comm.value else None)
            if comm.value:
                self.abort(comm)
            raise err
        return comm, rc

    def async_error(self, comm) -> int:
        out = ctypes.c_int(0)
        self.check(self.call("ncclCommGetAsyncError", comm, ctypes.byref(out)), "ncclCommGetAsyncError", comm)
        return out.value

    def abort(self, comm) -> int:
        return self.call("ncclCommAbort", comm)

    def destroy(self, comm) -> int:
        return self.call("ncclCommDestroy", comm)

    def revoke(self, comm) -> int:
        return self.call(REVOKE_SYMBOL, comm, 0)

    def raise_abort(self, comm) -> int:
        """Raise the comm's abort flags and nothing else (hpct's patch; no lock needed)."""
        return self.call(RAISE_ABORT_SYMBOL, comm)

    def addresses(self) -> dict[str, int]:
        """The address of every function the native launch calls (native.py), by NCCL's name."""
        return {name: ctypes.cast(self._fn[name], ctypes.c_void_p).value
                for name in ("ncclGroupStart", "ncclGroupEnd", *OP_FUNCTIONS.values())}

    def group_start(self) -> int:
        return self._fn["ncclGroupStart"]()

    def group_end(self) -> int:
        """ncclGroupEnd's result, not raised (ncclInProgress on a nonblocking comm)."""
        return self._fn["ncclGroupEnd"]()

    # Collectives: buffers are device pointers (ints), stream a cudaStream_t (int).
    def all_reduce(self, send, recv, count, dtype, op, comm, stream):
        return self.call("ncclAllReduce", send, recv, count, dtype, op, comm, stream)

    def broadcast(self, send, recv, count, dtype, root, comm, stream):
        return self.call("ncclBroadcast", send, recv, count, dtype, root, comm, stream)

    def reduce(self, send, recv, count, dtype, op, root, comm, stream):
        return self.call("ncclReduce", send, recv, count, dtype, op, root, comm, stream)

    def all_gather(self, send, recv, count, dtype, comm, stream):
        return self.call("ncclAllGather", send, recv, count, dtype, comm, stream)

    def reduce_scatter(self, send, recv, count, dtype, op, comm, stream):
        return self.call("ncclReduceScatter", send, recv, count, dtype, op, comm, stream)

    def send(self, buf, count, dtype, peer, comm, stream):
        return self.call("ncclSend", buf, count, dtype, peer, comm, stream)

    def recv(self, buf, count, dtype, peer, comm, stream):
        return self.call("ncclRecv", buf, count, dtype, peer, comm, stream)


# An op's call names (ops.py) and the NCCL function each runs.
OP_FUNCTIONS = {"all_reduce": "ncclAllReduce", "broadcast": "ncclBroadcast", "reduce": "ncclReduce",
                 "all_gather": "ncclAllGather", "reduce_scatter": "ncclReduceScatter", "send": "ncclSend",
                 "recv": "ncclRecv"}


# ---------------------------------------------------------------------------- torch mapping
# ncclDataType_t; float8 needs NCCL >= 2.24 (checked at mapping time; 2.21.5 has ten types).
_DTYPES = {"int8": 0, "uint8": 1, "bool": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
           "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
           "float8_e4m3fn": 10, "float8_e5m2": 11}
FLOAT8_MIN_VERSION = 22400


def nccl_dtype(dtype, version: int = 0) -> int:
    """ncclDataType_t of a torch dtype, or HpctArgumentError (complex: view it as real first)."""
    name = str(dtype).removeprefix("torch.")
    code = _DTYPES.get(name)
    if code is None:
        hint = "view complex tensors as real (torch.view_as_real)" if "complex" in name else \
            "use a dtype NCCL supports: " + ", ".join(sorted(set(_DTYPES)))
        raise HpctArgumentError(f"NCCL has no data type for {dtype}", fix=hint)
    if code >= 10 and version and version < FLOAT8_MIN_VERSION:
        raise HpctArgumentError(f"{dtype} needs NCCL 2.24 or newer (this libnccl is {version_text(version)})",
                            fix="upgrade libnccl, or cast to bfloat16")
    return code


# ncclRedOp_t
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4


def nccl_op(op, dtype=None) -> int:
    """ncclRedOp_t of a torch ReduceOp (as ProcessGroupNCCL maps it), or HpctArgumentError."""
    import torch.distributed as dist
    R = dist.ReduceOp
    kind = getattr(op, "op", op)
    is_bool = dtype is not None and str(dtype) == "torch.bool"
    table = {R.SUM: NCCL_SUM, R.PRODUCT: NCCL_PROD, R.MAX: NCCL_MAX, R.MIN: NCCL_MIN, R.AVG: NCCL_AVG}
    for known, code in table.items():
        if kind == known:
            if is_bool:   # bool travels as uint8: sum is "any", product is "all" (as ProcessGroupNCCL)
                if code == NCCL_AVG:
                    raise HpctArgumentError("ReduceOp.AVG is not supported for torch.bool tensors with NCCL",
                                        fix="reduce bool tensors with SUM, PRODUCT, MIN or MAX")
                return {NCCL_SUM: NCCL_MAX, NCCL_PROD: NCCL_MIN}.get(code, code)
            return code
    label = getattr(kind, "name", None) or str(kind).rsplit(".", 1)[-1]
    raise HpctArgumentError(f"Cannot use ReduceOp.{label} with NCCL (hpct backend)",
                        fix="use SUM, PRODUCT, MIN, MAX or AVG on CUDA tensors")
