"""The extension's Gloo and libtorch_cpu.so's Gloo never resolve to each other."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

CREATE_DEVICE = "_ZN4gloo9transport3tcp12CreateDeviceERKNS1_4attrE"

PROBE = f"""
import ctypes, os, sys
{{prelude}}
import torch
import hpct._gloo as ext
libtorch = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
theirs = ctypes.cast(getattr(ctypes.CDLL(libtorch), "{CREATE_DEVICE}"), ctypes.c_void_p).value
mine = ext.own_create_device()
print(ext.object_of(mine))
print(ext.object_of(theirs))
print(mine != theirs)
print(ext.object_of(ext.global_create_device()) or "(not globally visible)")
"""


def _probe(prelude: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(prelude=prelude)], capture_output=True,
                          text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


def test_extension_calls_its_own_gloo_next_to_torch():
    mine, theirs, differ, _ = _probe("")
    assert "hpct/_gloo" in mine
    assert theirs.endswith("libtorch_cpu.so")
    assert differ == "True"


def test_own_gloo_wins_even_when_torch_is_loaded_globally():
    # RTLD_GLOBAL puts libtorch's exported Gloo into the global scope: an exported or
    # interposable copy in the extension would then bind to libtorch's code.
    mine, theirs, differ, global_owner = _probe(
        "sys.setdlopenflags(os.RTLD_GLOBAL | os.RTLD_NOW)")
    assert global_owner.endswith("libtorch_cpu.so"), "libtorch's Gloo should be globally visible here"
    assert "hpct/_gloo" in mine and differ == "True"


def test_extension_exports_no_gloo_symbol():
    import hpct._gloo as ext
    out = subprocess.run(["nm", "-D", "--defined-only", ext.__file__], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    exported = [line.split()[-1] for line in out.splitlines() if "4gloo" in line]
    assert exported == []
    assert "PyInit__gloo" in out


def test_extension_carries_the_series_it_was_built_with(repo):
    import json
    from importlib.resources import files

    import hpct._gloo as ext
    expected = json.loads(files("hpct").joinpath("_series.json").read_text())
    assert ext.series_id() == expected["series_id"]
    assert expected["patches"][0] == "0001-test-accept-any-OpenSSL-for-the-test-build.patch"
