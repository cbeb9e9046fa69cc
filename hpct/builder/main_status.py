"""hpct-build status"""

from __future__ import annotations

import argparse

from ..cliutil import print_json
from . import patches
from .builder import built_info
from .common import add_root, layout_of, manifests_of
from .layout import Layout
from .sources import Manifest, fetched_info
from .wheel import installed_wheel_info, wheel_files


def component_status(layout: Layout, m: Manifest) -> dict:
    try:
        series = patches.load_series(layout, m)
        series_id, n, series_error = series.identity(), len(series.entries), None
    except Exception as err:  # a broken series is itself a status to report
        series_id, n, series_error = None, 0, str(err)
    fetched = fetched_info(layout, m)
    patched = patches.patched_info(layout, m)
    built = built_info(layout, m)
    return {
        "name": m.name, "version": m.version,
        "fetched": bool(fetched), "provider": (fetched or {}).get("provider"),
        "sha256": (fetched or {}).get("sha256"),
        "series_id": series_id, "patches": n, "series_error": series_error,
        "patched": bool(patched) and patched.get("series_id") == series_id,
        "built": bool(built) and built.get("series_id") == series_id,
        "built_series_id": (built or {}).get("series_id"),
    }


def configure_parser(p: argparse.ArgumentParser) -> None:
    add_root(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def execute(args: argparse.Namespace) -> int:
    layout = layout_of(args)
    rows = [component_status(layout, m) for m in manifests_of(layout, None)]
    wheel = installed_wheel_info()
    wheel["dist"] = [w.name for w in wheel_files(layout)]
    if args.json:
        print_json({"root": str(layout.root), "components": rows, "wheel": wheel})
        return 0
    yes = lambda b: "yes" if b else "no"  # noqa: E731
    print(f"{'component':10} {'version':9} {'fetched':14} {'series':24} {'patched':8} {'built':6}")
    for r in rows:
        fetched = f"yes ({r['provider']})" if r["fetched"] else "no"
        series = f"{r['patches']} patches {r['series_id']}" if r["series_id"] else f"ERROR {r['series_error']}"
        if r["patches"] == 0 and r["series_id"]:
            series = "none"
        built = yes(r["built"]) if r["name"] in ("gloo", "nccl") else "-"
        print(f"{r['name']:10} {r['version']:9} {fetched:14} {series:24} {yes(r['patched']) if r['patches'] else '-':8} {built:6}")
    if wheel.get("installed"):
        ext = f"extension series {wheel['series_id']}" if wheel.get("extension") else \
            f"extension NOT loadable: {wheel.get('extension_error')}"
        print(f"hpct wheel {wheel['hpct_version']} installed; {ext}")
    else:
        print("hpct wheel not installed (hpct-build wheel --install)")
    return 0
