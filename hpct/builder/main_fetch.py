"""hpct-build fetch"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import ConfigError, HpctError, SourceError
from .common import add_components, add_root, layout_of, manifests_of, progress_of
from .sources import Manifest, fetch

SOURCE_ENV = "HPCT_{NAME}_SOURCE"   # e.g. HPCT_NCCL_SOURCE: a tarball or tree for that component
# e.g. HPCT_NCCL_SOURCES: a folder of tag tarballs named as the manifest's providers name them
# (nccl-<version>-1.tar.gz), one per pinned version; fetch takes the one of the version asked.
SOURCES_ENV = "HPCT_{NAME}_SOURCES"


def source_for(m: Manifest, explicit: Path | None) -> Path | None:
    """--source, else HPCT_<NAME>_SOURCE, else this version's tarball in HPCT_<NAME>_SOURCES."""
    if explicit is not None:
        return explicit
    value = os.environ.get(SOURCE_ENV.format(NAME=m.name.upper()))
    if value:
        return Path(value)
    folder_var = SOURCES_ENV.format(NAME=m.name.upper())
    folder = os.environ.get(folder_var)
    if not folder:
        return None
    names = [p.file for p in m.providers]
    for name in names:
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    where = "is not a folder" if not Path(folder).is_dir() else f"holds no {' or '.join(names)}"
    raise SourceError(f"{folder_var}={folder} {where} ({m.name} {m.version})",
                      fix=f"put {names[0]} there (git archive --format=tar --prefix={names[0].removesuffix('.tar.gz')}/ "
                          f"<tag> | gzip -n), or unset {folder_var}")


def configure_parser(p: argparse.ArgumentParser) -> None:
    add_root(p)
    add_components(p)
    p.add_argument("--source", type=Path, default=None,
                   help="a local tarball or unpacked tree to use instead of downloading "
                        "(one component only; also HPCT_<COMPONENT>_SOURCE)")
    p.add_argument("--force", action="store_true", help="fetch again even if already fetched")


def execute(args: argparse.Namespace) -> int:
    layout, progress = layout_of(args), progress_of(args)
    manifests = manifests_of(layout, args.components)
    if args.source is not None and len(manifests) != 1:
        raise ConfigError("--source needs exactly one component", fix="e.g. hpct-build fetch nccl --source PATH")
    failures: list[HpctError] = []
    for m in manifests:
        try:
            fetch(layout, m, progress, source=source_for(m, args.source), force=args.force)
        except HpctError as err:
            if len(manifests) == 1:
                raise
            print(f"hpct-build: {m.name}: {err}", file=sys.stderr)
            failures.append(err)
    return failures[0].exit_code if failures else 0
