"""Micro-costs on loopback for benchmarks/model.py: one connect, one message hop, one byte
of a bulk transfer, one store request, one Python + torch start.  Each is the mean of many
repetitions."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

CONNECTS = 300
ROUND_TRIPS = 3000
STORE_OPS = 2000
BULK_BYTES = 64 << 20          # one bulk transfer: NCCL's init moves ~140 MB per rank at 100K ranks
BULK_CHUNK = 1 << 20


def _echo_server(listener: socket.socket, rounds: int) -> None:
    """Child: answer each connection's 8-byte word (the handshake), then ping-pong on one."""
    for _ in range(CONNECTS):
        c, _ = listener.accept()
        c.sendall(c.recv(8))
        c.close()
    c, _ = listener.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(rounds):
        c.sendall(c.recv(8))
    c.close()


def connect_and_hop() -> tuple[float, float]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    addr = listener.getsockname()
    pid = os.fork()
    if pid == 0:
        try:
            _echo_server(listener, ROUND_TRIPS)
        finally:
            os._exit(0)
    listener.close()
    try:
        t = time.perf_counter()
        for _ in range(CONNECTS):
            with socket.create_connection(addr, timeout=10) as s:
                s.sendall(b"12345678")
                s.recv(8)
        conn = (time.perf_counter() - t) / CONNECTS
        with socket.create_connection(addr, timeout=10) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = time.perf_counter()
            for _ in range(ROUND_TRIPS):
                s.sendall(b"12345678")
                s.recv(8)
            hop = (time.perf_counter() - t) / ROUND_TRIPS / 2
    finally:
        os.waitpid(pid, 0)
    return conn, hop


def byte_cost() -> float:
    """Seconds per byte of one large transfer between two processes (sent, received, answered)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    addr = listener.getsockname()
    pid = os.fork()
    if pid == 0:
        try:
            c, _ = listener.accept()
            buf, got = bytearray(BULK_CHUNK), 0
            while got < BULK_BYTES:
                n = c.recv_into(buf)
                if n == 0:
                    break
                got += n
            c.sendall(b"k")
            c.close()
        finally:
            os._exit(0)
    listener.close()
    try:
        chunk = b"\xa5" * BULK_CHUNK
        with socket.create_connection(addr, timeout=30) as s:
            t = time.perf_counter()
            for _ in range(BULK_BYTES // BULK_CHUNK):
                s.sendall(chunk)
            s.recv(1)
            return (time.perf_counter() - t) / BULK_BYTES
    finally:
        os.waitpid(pid, 0)


def store_op() -> float | None:
    try:
        import datetime
        from torch.distributed import TCPStore
    except ImportError:
        return None
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    t = time.perf_counter()
    for i in range(STORE_OPS // 2):
        store.set(f"k{i}", b"x" * 64)
        store.get(f"k{i}")
    return (time.perf_counter() - t) / STORE_OPS


def proc_start() -> float | None:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", "import torch, torch.distributed"], capture_output=True,
                       timeout=120)
    return time.perf_counter() - t if r.returncode == 0 else None


def micro_costs() -> dict:
    conn, hop = connect_and_hop()
    return {"conn_s": conn, "hop_s": hop, "byte_s": byte_cost(), "store_op_s": store_op(),
            "proc_start_s": proc_start()}
