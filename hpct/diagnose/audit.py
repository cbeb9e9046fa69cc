"""The settings audit: what each rank runs with, and which values differ where they must not.

Each rank reports its NCCL_*, HPCT_* and TORCH_* variables (a value that looks like a
secret is replaced by a short digest: still compared, never shown), the interface that holds
its address and that interface's MTU, the kernel's ephemeral port range and reserved ports,
and the torch / NCCL / hpct versions with the Gloo series id.  A value the rank cannot read
is "unknown" and never counts as a difference.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import socket
import struct
from pathlib import Path

from ..sysctl import PORT_RANGE, RESERVED_PORTS, Sysctl

PREFIXES = ("NCCL_", "HPCT_", "TORCH_")
UNKNOWN = "unknown"
# Names whose value is a credential, and values shaped like one (long hex or base64 runs).
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASS|CREDENTIAL|AUTH", re.I)
SECRET_VALUE = re.compile(r"^[A-Za-z0-9+/=_-]{32,}$")
# Per-rank by nature: differing is expected.
PER_RANK = frozenset({"HPCT_GENERATION"})
SIOCGIFADDR = 0x8915


def redact(name: str, value: str) -> str:
    if SECRET_NAME.search(name) or (SECRET_VALUE.match(value) and not value.isdigit()):
        return "redacted:" + hashlib.blake2b(value.encode(), digest_size=4).hexdigest()
    return value


def _ipv4_of(ifname: str) -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        return socket.inet_ntoa(raw[20:24])
    except OSError:
        return None


def interface_of(host: str, sys_class_net: Path = Path("/sys/class/net")) -> tuple[str, str]:
    """(interface, MTU) of the interface holding ``host``'s address here, or "unknown"."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return UNKNOWN, UNKNOWN
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            try:
                return name, (sys_class_net / name / "mtu").read_text().strip()
            except OSError:
                return name, UNKNOWN
    return UNKNOWN, UNKNOWN


def _read(sysctl: Sysctl, name: str) -> str:
    try:
        return " ".join(sysctl.read(name).split()) or "(empty)"
    except Exception:          # noqa: BLE001 -- unreadable is a value of its own, not an error
        return UNKNOWN


def versions() -> dict:
    out = {}
    try:
        import torch
        out["torch"] = torch.__version__
        nccl = getattr(torch.cuda, "nccl", None)
        out["torch NCCL"] = ".".join(map(str, nccl.version())) if nccl and torch.cuda.is_available() else "none"
    except Exception:          # noqa: BLE001
        out["torch"] = UNKNOWN
    try:
        from importlib.metadata import version
        out["hpct"] = version("hpct")
    except Exception:          # noqa: BLE001
        out["hpct"] = UNKNOWN
    try:
        from .. import _gloo
        out["gloo series"] = str(_gloo.series_id())
    except Exception:          # noqa: BLE001
        out["gloo series"] = UNKNOWN
    return out


def collect(host: str, env=os.environ, proc_sys: str = "/proc/sys") -> dict:
    """This rank's settings, flat: name -> text."""
    sysctl = Sysctl(proc_sys)
    got = {f"env {k}": redact(k, v) for k, v in sorted(env.items()) if k.startswith(PREFIXES)}
    got["interface"], got["mtu"] = interface_of(host)
    got["port range"] = _read(sysctl, PORT_RANGE)
    got["reserved ports"] = _read(sysctl, RESERVED_PORTS)
    got.update(versions())
    return got


def differences(per_rank: list[dict]) -> dict[str, dict[str, list[int]]]:
    """Settings whose known values differ: name -> value -> ranks holding it.  A name absent
    on some ranks differs too ("(unset)"); the interface's name may differ between nodes."""
    names = sorted({k for d in per_rank for k in d} - {"interface"} - {f"env {n}" for n in PER_RANK})
    out = {}
    for name in names:
        holders: dict[str, list[int]] = {}
        for rank, d in enumerate(per_rank):
            value = d.get(name, "(unset)")
            if value != UNKNOWN:
                holders.setdefault(value, []).append(rank)
        if len(holders) > 1:
            out[name] = holders
    return out
