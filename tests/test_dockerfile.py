"""The Dockerfile cannot be built here (no Docker engine): check what it runs instead."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.unit


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_runs_only_commands_the_project_has(repo):
    from hpct.build.cli import VERBS as BUILD_VERBS
    from hpct.cli import VERBS
    steps = _instructions((repo / "Dockerfile").read_text())
    assert steps[0][0] == "FROM" and steps[0][1]
    runs = " && ".join(rest for word, rest in steps if word == "RUN")
    for script in re.findall(r"bash (\S+\.sh)", runs):
        assert (repo / script).is_file(), script
    for verb in re.findall(r"-m hpct\.build (\w+)", runs):
        assert verb in BUILD_VERBS, verb
    entry = dict(steps)
    assert '"hpct"' in entry["ENTRYPOINT"]
    assert entry["CMD"].strip('[]"') in VERBS
