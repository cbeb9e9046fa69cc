"""The doctor's "c10d patches" row: does this torch carry hpct's PyTorch series, the one this hpct has?

A patched torch says so in its version, ``2.6.0+hpct.<series id>``, whichever recipe made it: a
full source build (``hpct-build build pytorch``) or PyPI's wheel with the series built out of
tree (``hpct-build wheel torch=2.6.0``).  The latter also carries ``torch._hpct_c10d`` and its
record (``torch/_hpct_series.json``), and its ``torch.distributed`` must have put the module's
classes in place.  The series id this hpct expects is the identity of the PyTorch series among
the build inputs its wheel carries (``hpct/_build_inputs``), the same inputs hpct-build uses.
"""

from __future__ import annotations

OUT_OF_TREE = "torch.distributed._hpct_out_of_tree"
REBUILD_FIX = ("build and install the torch of this hpct's series: hpct-build wheel torch=2.6.0, then "
               "pip install the wheel it prints (or install the hpct release that made this torch)")


def expected_torch_series() -> str | None:
    """The PyTorch series id of this hpct's build inputs; None when it runs from a source tree."""
    from .builder.layout import Layout, packaged_inputs
    inputs = packaged_inputs()
    if inputs is None:
        return None
    from .builder.patches import load_series
    from .builder.sources import load_manifest
    layout = Layout(inputs)
    return load_series(layout, load_manifest(layout, "pytorch")).identity()


def series_of(version: str) -> str | None:
    """``2.6.0+hpct.0ba526a61bc0d199`` -> ``0ba526a61bc0d199``; None for a torch without the label."""
    local = version.partition("+")[2].split(".")
    return local[1] if len(local) >= 2 and local[0] == "hpct" else None


def check_c10d_patches(probe, torch):
    from .doctor import Row
    if torch is None:
        return Row("c10d patches", "skip", "PyTorch is not importable")
    version = str(getattr(torch, "__version__", ""))
    have = series_of(version)
    if have is None:
        return Row("c10d patches", "info",
                   f"stock PyTorch {version}: rootless start-up goes through hpct's own backend")
    how, error = _out_of_tree(probe)
    if error is not None:
        return Row("c10d patches", "fail", f"{version}: {error}", REBUILD_FIX)
    try:
        want = probe.torch_series()
    except Exception as err:    # a damaged install: the row says so, the other rows still run
        return Row("c10d patches", "fail", f"hpct's own build inputs are unreadable: {err}",
                   "reinstall hpct from its wheel")
    if want is None:
        return Row("c10d patches", "ok", f"{version} carries hpct's c10d series {have} ({how}); the series "
                                         "this hpct expects is unknown (it is not installed from a wheel)")
    if have != want:
        return Row("c10d patches", "fail", f"{version} carries c10d series {have}, but this hpct's series is "
                                           f"{want}", REBUILD_FIX)
    return Row("c10d patches", "ok", f"{version} carries hpct's c10d series {have}, this hpct's own ({how})")


def _out_of_tree(probe) -> tuple[str, str | None]:
    """(how the series is built in, or the error that makes it unusable)."""
    try:
        oot = probe.import_module(OUT_OF_TREE)
    except ModuleNotFoundError:
        return "built into torch from source", None
    except ImportError as err:          # HpctTorchError: the module is there and does not load
        return "", str(err)
    try:
        record = oot.record()
        c10d = probe.import_module("torch._C._distributed_c10d")
    except Exception as err:
        return "", f"its build record is unreadable: {type(err).__name__}: {err}"
    if not getattr(c10d, "_hpct_out_of_tree", False):
        return "", "torch._hpct_c10d is installed but not in use (torch.distributed did not put its classes in place)"
    module = record.get("module", {})
    nccl = "ProcessGroupNCCL too" if module.get("nccl") else "ProcessGroupNCCL stock"
    return (f"out of tree in torch._hpct_c10d with Gloo series {record.get('gloo_series_id')}, {nccl}; "
            f"needs {', '.join(module.get('needs', []))}"), None
