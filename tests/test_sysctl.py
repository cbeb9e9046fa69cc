"""hpct.sysctl and `hpct ports`: unit tests on a fake /proc/sys, then the real thing in namespaces.

Real kernel values are changed only inside namespaces these tests create; the
machine's own values are read before and after to prove they were not touched.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from hpct.cli import main
from hpct.errors import SysctlError
from hpct.sysctl import (PORT_RANGE, RESERVED_PORTS, Sysctl, Write, apply, format_ranges, parse_port_range,
                         parse_ranges, plan_writes)
from hpct.testing.netns import netns, netns_network, unavailable_reason

GLOO, NCCL = range(12000, 12008), range(12008, 12016)
HIGH_GLOO, HIGH_NCCL = range(30000, 30008), range(30008, 30016)


@pytest.fixture
def proc(tmp_path: Path) -> Sysctl:
    """A fake /proc/sys with the kernel's default values and spelling (tab-separated range)."""
    ipv4 = tmp_path / "net" / "ipv4"
    ipv4.mkdir(parents=True)
    (ipv4 / "ip_local_port_range").write_text("32768\t60999\n")
    (ipv4 / "ip_local_reserved_ports").write_text("\n")
    return Sysctl(tmp_path)


# ---------------------------------------------------------------- unit

@pytest.mark.unit
def test_parse_and_format_ranges():
    assert parse_ranges("") == set() and parse_ranges("\n") == set()
    assert parse_ranges("12000-12003,13000\n") == {12000, 12001, 12002, 12003, 13000}
    assert format_ranges({12000, 12001, 12002, 12003, 13000}) == "12000-12003,13000"
    assert format_ranges([range(5, 8), 9, 1]) == "1,5-7,9"
    assert format_ranges([range(5, 9), 9, 1]) == "1,5-9"
    assert parse_port_range("32768\t60999\n") == (32768, 60999)


@pytest.mark.unit
@pytest.mark.parametrize("text,message", [
    ("12000-abc", "net.ipv4.ip_local_reserved_ports: cannot parse '12000-abc' in '12000-abc'"),
    ("5-3", "net.ipv4.ip_local_reserved_ports: bad port span '5-3'"),
    ("70000", "net.ipv4.ip_local_reserved_ports: bad port span '70000'"),
])
def test_parse_ranges_rejects(text, message):
    with pytest.raises(SysctlError) as err:
        parse_ranges(text)
    assert err.value.problem == message


@pytest.mark.unit
def test_parse_port_range_rejects():
    with pytest.raises(SysctlError, match=r"net.ipv4.ip_local_port_range: cannot parse '20000'"):
        parse_port_range("20000")


@pytest.mark.unit
def test_plan_writes():
    # Blocks below the floor: only the floor moves (the high end stays).
    assert plan_writes((32768, 60999), set(), [GLOO, NCCL]) == [Write(PORT_RANGE, "20000 60999")]
    assert plan_writes((20000, 60999), set(), [GLOO, NCCL]) == []
    # Blocks above the floor are reserved, merged with what is there, and before the floor moves.
    assert plan_writes((32768, 60999), {40000, 40001}, [HIGH_GLOO, HIGH_NCCL]) == [
        Write(RESERVED_PORTS, "30000-30015,40000-40001"), Write(PORT_RANGE, "20000 60999")]
    assert plan_writes((20000, 60999), set(range(30000, 30016)), [HIGH_GLOO, HIGH_NCCL]) == []
    # A high end at or below the floor would make an empty range: it becomes 65535.
    assert plan_writes((10000, 15000), set(), [GLOO]) == [Write(PORT_RANGE, "20000 65535")]
    assert plan_writes((32768, 60999), set(), [GLOO], floor=13000) == [Write(PORT_RANGE, "13000 60999")]
    assert Write(PORT_RANGE, "20000 60999").command == 'sysctl -w net.ipv4.ip_local_port_range="20000 60999"'


@pytest.mark.unit
def test_plan_writes_rejects_a_bad_floor():
    with pytest.raises(SysctlError) as err:
        plan_writes((32768, 60999), set(), [GLOO], floor=80)
    assert err.value.problem == "ephemeral floor 80 is outside 1024..65534"
    assert "--ephemeral-floor" in err.value.fix


@pytest.mark.unit
def test_apply_writes_and_reads_back(proc):
    proc.path(RESERVED_PORTS).write_text("40000-40001\n")
    writes = apply(proc, [HIGH_GLOO, HIGH_NCCL])
    assert [w.name for w in writes] == [RESERVED_PORTS, PORT_RANGE]
    assert proc.port_range() == (20000, 60999)
    assert proc.reserved_ports() == set(range(30000, 30016)) | {40000, 40001}
    assert apply(proc, [HIGH_GLOO, HIGH_NCCL]) == []     # idempotent


@pytest.mark.unit
def test_dry_run_writes_nothing(proc):
    writes = apply(proc, [HIGH_GLOO], dry_run=True)
    assert [w.command for w in writes] == ['sysctl -w net.ipv4.ip_local_reserved_ports="30000-30007"',
                                           'sysctl -w net.ipv4.ip_local_port_range="20000 60999"']
    assert proc.port_range() == (32768, 60999) and proc.reserved_ports() == set()


@pytest.mark.unit
@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM])
def test_no_privilege_gives_the_sysctl_command(proc, monkeypatch, code):
    def refuse(self, write):
        raise OSError(code, "Permission denied")
    monkeypatch.setattr(Sysctl, "_write_one", refuse)
    with pytest.raises(SysctlError) as err:
        apply(proc, [HIGH_GLOO])
    assert err.value.problem == "no permission to write net.ipv4.ip_local_reserved_ports (Permission denied)"
    assert err.value.fix == ('run as root: sysctl -w net.ipv4.ip_local_reserved_ports="30000-30007"; '
                             'sysctl -w net.ipv4.ip_local_port_range="20000 60999"')
    assert err.value.exit_code == 8


@pytest.mark.unit
def test_read_only_proc_sys_names_the_container_way(proc, monkeypatch):
    def refuse(self, write):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(Sysctl, "_write_one", refuse)
    with pytest.raises(SysctlError) as err:
        apply(proc, [GLOO])
    assert err.value.problem == f"{proc.path(PORT_RANGE)} is read-only here (a container's /proc/sys)"
    assert err.value.fix.endswith('securityContext.sysctls: sysctl -w net.ipv4.ip_local_port_range="20000 60999"')


@pytest.mark.unit
def test_failed_second_write_undoes_the_first(proc, monkeypatch):
    real = Sysctl._write_one

    def refuse_range(self, write):
        if write.name == PORT_RANGE:
            raise OSError(errno.EINVAL, "Invalid argument")
        real(self, write)
    monkeypatch.setattr(Sysctl, "_write_one", refuse_range)
    proc.path(RESERVED_PORTS).write_text("40000\n")
    with pytest.raises(SysctlError) as err:
        apply(proc, [HIGH_GLOO])
    assert err.value.problem == "the kernel refused net.ipv4.ip_local_port_range='20000 60999' (Invalid argument)"
    assert proc.reserved_ports() == {40000}      # restored, not half-applied


@pytest.mark.unit
def test_read_back_mismatch_is_an_error(proc, monkeypatch):
    def ignore(self, write):
        pass    # a kernel (or agent) that silently keeps the old value
    monkeypatch.setattr(Sysctl, "_write_one", ignore)
    with pytest.raises(SysctlError) as err:
        apply(proc, [GLOO])
    assert err.value.problem == ("net.ipv4.ip_local_port_range reads back '32768\\t60999' after writing "
                                 "'20000 60999'")


@pytest.mark.unit
def test_missing_proc_file(tmp_path):
    with pytest.raises(SysctlError, match=r"cannot read net.ipv4.ip_local_port_range at .*: No such file"):
        Sysctl(tmp_path).port_range()


@pytest.mark.unit
def test_ports_cli_on_fake_proc(proc, monkeypatch, capsys):
    for name in list(os.environ):
        if name.startswith("HPCT_") or name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HPCT_PORT_BASE", "40000")
    root = str(proc.root)
    assert main(["ports", "check", "--proc-sys", root]) == 9
    err = capsys.readouterr().err
    assert err.startswith("hpct: error: 8 of the gloo block's ports (40000-40007) lie in the ephemeral range "
                          "32768-60999 and are not reserved; 8 of the nccl block's ports (40008-40015)"), err
    assert main(["ports", "apply", "--dry-run", "--proc-sys", root]) == 0
    assert 'sysctl -w net.ipv4.ip_local_reserved_ports="40000-40015"' in capsys.readouterr().out
    assert main(["ports", "apply", "--json", "--proc-sys", root]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and len(doc["writes"]) == 2
    assert main(["ports", "check", "--json", "--proc-sys", root]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["ports", "plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"]["blocks"]["nccl"] == {"first": 40008, "last": 40015}
    assert plan["listen_ports"]["gloo"]["0"] == list(range(40000, 40008))
    assert plan["hpct_gloo_ports"] == {"0": 40000}
    monkeypatch.setenv("HPCT_PORT_BSAE", "1")
    assert main(["ports", "plan"]) == 2
    assert "did you mean HPCT_PORT_BASE?" in capsys.readouterr().err


# ---------------------------------------------------------------- real namespaces

needs_netns = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
HOST_FILES = [Path("/proc/sys/net/ipv4/ip_local_port_range"), Path("/proc/sys/net/ipv4/ip_local_reserved_ports")]
CLEAN_ENV = {"HPCT_PORT_BASE": "40000"}     # inside the default ephemeral range 32768-60999


@pytest.fixture
def host_values_untouched():
    before = [p.read_text() for p in HOST_FILES]
    yield
    assert [p.read_text() for p in HOST_FILES] == before


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HPCT_") and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    return {**env, **CLEAN_ENV, **extra}


@pytest.mark.multihost
@needs_netns
def test_apply_and_check_in_a_namespace(host_values_untouched):
    with netns("hpct-sysctl") as ns:
        ns.run(["sh", "-c", "echo 50000-50001 > /proc/sys/net/ipv4/ip_local_reserved_ports"], check=True)
        before = ns.hpct("ports", "check", env=_env())
        assert before.returncode == 9, before.stderr
        assert "gloo block's ports (40000-40007) lie in the ephemeral range 32768-60999" in before.stderr
        assert "fix: run `hpct ports apply`" in before.stderr
        dry = ns.hpct("ports", "apply", "--dry-run", env=_env())
        assert dry.returncode == 0, dry.stderr
        assert dry.stdout.splitlines()[1:] == [
            '  sysctl -w net.ipv4.ip_local_reserved_ports="40000-40015,50000-50001"',
            '  sysctl -w net.ipv4.ip_local_port_range="20000 60999"']
        assert ns.read_sysctl(RESERVED_PORTS) == "50000-50001"          # dry run changed nothing
        done = ns.hpct("ports", "apply", env=_env())
        assert done.returncode == 0, done.stderr
        assert ns.read_sysctl(PORT_RANGE).split() == ["20000", "60999"]
        assert ns.read_sysctl(RESERVED_PORTS) == "40000-40015,50000-50001"
        after = ns.hpct("ports", "check", env=_env())
        assert after.returncode == 0 and after.stdout.startswith("ok:"), after.stderr
        again = ns.hpct("ports", "apply", env=_env())
        assert again.stdout.startswith("nothing to do"), again.stdout


@pytest.mark.multihost
@needs_netns
def test_without_privilege_the_fix_is_the_sysctl_command(host_values_untouched):
    # Import everything first, then drop to nobody: only the /proc/sys write needs privilege.
    code = ("import os, sys, locale, gettext, hpct.cli, hpct.main_ports, hpct.sysctl, hpct.config, hpct.ports\n"
            "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
            "sys.exit(hpct.cli.main(['ports', 'apply']))\n")
    with netns("hpct-sysctl") as ns:
        proc = ns.python(code, env=_env(HPCT_PORT_BASE="12000"))
        assert proc.returncode == 8, proc.stderr
        assert proc.stderr.splitlines() == [
            "hpct: error: no permission to write net.ipv4.ip_local_port_range (Permission denied)",
            '  fix: run as root: sysctl -w net.ipv4.ip_local_port_range="20000 60999"']
        assert ns.read_sysctl(PORT_RANGE).split() == ["32768", "60999"]


@pytest.mark.multihost
@needs_netns
def test_namespace_network_has_separate_values_and_connects(host_values_untouched):
    with netns_network(2, "hpct-net") as (a, b):
        assert a.hpct("ports", "apply", "--ephemeral-floor", "25000", env=_env()).returncode == 0
        assert a.read_sysctl(PORT_RANGE).split() == ["25000", "60999"]
        assert b.read_sysctl(PORT_RANGE).split() == ["32768", "60999"]
        server = a.popen(["python3", "-c",
                          "import socket,sys; s=socket.create_server((sys.argv[1], 40000)); print('up', flush=True);"
                          " c,_=s.accept(); c.sendall(b'hi'); c.close()", a.address],
                         stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "up"
            code = ("import socket,sys; c=socket.create_connection((sys.argv[1], 40000), timeout=10);"
                    " print(c.recv(2).decode())")
            got = b.python(code, a.address)
            assert got.stdout.strip() == "hi", got.stderr
        finally:
            server.kill()
            server.wait(timeout=10)
