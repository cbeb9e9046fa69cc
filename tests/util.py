"""Helpers for the tests: run the installed console scripts with a timeout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ENTRY_POINTS = {"hpct-build": "hpct.builder.cli", "hpct": "hpct.cli"}


def seed_checkout(root: Path, repo: Path, archive: Path | None = None) -> Path:
    """A throw-away checkout at ``root``: the real manifests, patches and recipes, an empty work
    area, and ``archive`` (a verified source tarball) already in its cache when given."""
    for name in ("third_party", "patches", "build_scripts"):
        shutil.copytree(repo / name, root / name, ignore=shutil.ignore_patterns("src", "patched", "build", "cache"))
    if archive is not None:
        (root / "third_party" / "cache").mkdir()
        shutil.copy2(archive, root / "third_party" / "cache" / archive.name)
    return root


def run_cli(prog: str, *args: str, env: dict | None = None, timeout: float = 600,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run an installed console script (via its module, so PATH games are possible)."""
    code = f"import sys; from {ENTRY_POINTS[prog]} import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd or "/")


def same(a, b) -> bool:
    """Equal results as torch gives them: tensors of one dtype, shape and value, nested alike."""
    import torch
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def forked_job(*args, **kwargs):
    """hpct.demo.agent.Job whose ranks the suite's fork server starts (tests/zygote.py: torch is
    imported once per pytest process, not once per rank)."""
    from hpct.demo.agent import Job
    from zygote import ZYGOTE
    return Job(*args, launcher=ZYGOTE.launch, **kwargs)


def run_rank_script(tmp_path: Path, source: str, args: list[str], world: int, limit_s: float,
                    env: dict | None = None) -> tuple[dict, list[str]]:
    """Write ``source`` as a rank script and run it as ``world`` ranks of an hpct job (the
    local agent: ports from a free block, every process bounded by ``limit_s``); returns
    the exit codes by rank and each rank's output."""
    import time
    from hpct.demo.agent import free_port_block
    script = tmp_path / "rank_script.py"
    script.write_text(source)
    job = forked_job([sys.executable, str(script), *args], world, free_port_block(8 * world), tmp_path,
                     time.monotonic() + limit_s, env=env or {})
    with job:
        job.start_all()
        codes = job.wait_all()
        outputs = [job.output(r) for r in range(world)]
    return codes, outputs


def rootless_guarded(stack: list) -> bool:
    """True when one of ``stack`` (the AST nodes enclosing a call, outermost first) keeps
    the call off stock code paths: an ``_hpct*`` function, a branch on
    ``_hpct_rootless.enabled()``, or an ``if`` on a ``rootless``/``rootless_gloo`` flag."""
    import ast
    import re
    for node in stack:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_hpct"):
            return True
        if isinstance(node, (ast.If, ast.IfExp)) and "_hpct_rootless.enabled()" in ast.unparse(node.test):
            return True
        if isinstance(node, ast.If) and re.search(r"\brootless(_gloo)?\b", ast.unparse(node.test)):
            return True
    return False


def unguarded_calls(source: str, counted) -> tuple[int, list[str]]:
    """Walk the calls in Python ``source`` that ``counted(call)`` (an ``ast.Call``) selects:
    how many there are, and ``"line N: name"`` for each one not :func:`rootless_guarded`."""
    import ast
    unguarded, calls = [], 0

    def visit(node, stack):
        nonlocal calls
        if isinstance(node, ast.Call) and counted(node):
            calls += 1
            if not rootless_guarded(stack):
                unguarded.append(f"line {node.lineno}: {ast.unparse(node.func)}")
        for child in ast.iter_child_nodes(node):
            visit(child, stack + [node])

    visit(ast.parse(source), [])
    return calls, unguarded


def state_digest(model, opt) -> str:
    """16 hex digits over a model's state and its optimizer's tensors: equal means bit-identical."""
    import hashlib

    import torch
    h = hashlib.sha256()
    for t in [*model.state_dict().values(), *[v for s in opt.state.values() for v in s.values()
                                               if torch.is_tensor(v)]]:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
