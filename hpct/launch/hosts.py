"""Where ``hpct run`` learns the job's nodes and this node's place among them.

``hpct run``'s agents (one per node) find each other with no store and no root, so every agent
must derive the same ordered host list, and its own index in it, from what it sees locally.  The
scheduler has decided both already, so the user need not type them: Slurm writes a hostlist
(``SLURM_JOB_NODELIST``) and ``SLURM_NODEID``, Kubernetes operators give each replica a stable
pod name holding its index, MPI-style setups have a host file.  What does not add up (a bad
expression, a count that is not ``--nnodes``, a rank outside the list) is a LaunchError naming
the value and what to write, before any worker starts.

Pod-name layouts read by :func:`from_pod_name` (the name is the pod's hostname):

- Kubeflow PyTorchJob (training-operator v1): ``<job>-master-0`` is node 0 and ``<job>-worker-<i>``
  node ``i + 1``; with no Master replica ``<job>-worker-<i>`` is node ``i``.  A worker's name cannot
  tell which: ``master=`` says, by default yes when ``MASTER_ADDR`` names ``<job>-master-0`` (the
  operator sets it so on every pod of a job with a Master replica).
- JobSet and Kubeflow Trainer v2: hostname ``<jobset>-<replicatedjob>-<jobindex>-<podindex>``
  (Trainer v2: ``<job>-node-0-<i>``), one indexed Job whose pod ``i`` is node ``i``.  Layouts
  that put the nodes in several Jobs (job index other than 0) are refused.

Hostlists expand as ``scontrol show hostnames`` (Slurm 22.05) does, with no Slurm needed: items
split at commas or whitespace; ``[...]`` holds numbers and ``lo-hi`` ranges padded to the low
bound's width; a bracketed item ends with ``]``; groups in one item multiply in Slurm's order.
Stricter than Slurm: duplicates, empty items and stray ``]`` are refused; BlueGene's
``bgl[123x456]`` is not supported.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import product
from pathlib import Path

from hpct.errors import LaunchError

MAX_HOSTS = 65536
_RANGE_FIX = "inside brackets write numbers and ranges of numbers, e.g. node[001-004,007]"
_DIGITS = re.compile("[0-9]+")
_INDEX = r"(?:0|[1-9][0-9]*)"   # Kubernetes writes replica indexes without zero padding
_OPERATOR_POD = re.compile(rf"(?P<job>.+)-(?P<role>master|worker)-(?P<index>{_INDEX})")
_JOBSET_POD = re.compile(rf"(?P<stem>.+-.+)-(?P<job>{_INDEX})-(?P<pod>{_INDEX})")


@dataclass(frozen=True)
class NodeSource:
    """An ordered host list, where it came from, and what the scheduler says about this node."""

    hosts: tuple[str, ...]
    node_rank: int | None
    nproc_per_node: int | None
    source: str


def _items(expr: str) -> list[str]:
    """Split at commas and whitespace outside brackets, checking the brackets as it goes."""
    items: list[str] = []
    word, depth, opened, since_comma = "", 0, 0, False
    for pos, ch in enumerate(expr):
        if depth == 0 and (ch == "," or ch.isspace()):
            if word:
                items.append(word)
                word, since_comma = "", True
            if ch == ",":
                if not since_comma:
                    break
                since_comma = False
            continue
        if ch == "[":
            if depth:
                raise LaunchError(f"hostlist {expr!r}: '[' at position {pos} is inside another bracket",
                                  fix="brackets do not nest: write node[1-4], not node[[1-4]]")
            depth, opened = 1, pos
        elif ch == "]":
            if not depth:
                raise LaunchError(f"hostlist {expr!r}: ']' at position {pos} closes no '['",
                                  fix="open each range with '[': node[1-4]")
            depth = 0
        word += ch
    else:
        if depth:
            raise LaunchError(f"hostlist {expr!r}: '[' at position {opened} is never closed",
                              fix="close each bracket: node[1-4]")
        if word:
            items.append(word)
            since_comma = True
        if since_comma:
            return items
    raise LaunchError(f"hostlist {expr!r} has an empty item at position {pos} (two commas in a row, "
                      "or a comma at an end)", fix="separate host names by single commas: node1,node2")


def _group(text: str, expr: str) -> list[tuple[int, int, int]]:
    """``1-3,07`` -> [(1, 3, 1), (7, 7, 2)]: low, high, zero-padded width."""
    spans = []
    for part in text.split(","):
        if not part:
            raise LaunchError(f"hostlist {expr!r}: empty range in '[{text}]'", fix=_RANGE_FIX)
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part)
        if not match:
            raise LaunchError(f"hostlist {expr!r}: {part!r} in '[{text}]' is not a number or a "
                              "range of numbers", fix=_RANGE_FIX)
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise LaunchError(f"hostlist {expr!r}: range {part!r} runs backwards",
                              fix=f"write the lower number first: [{high_text}-{low_text}]")
        spans.append((low, high, len(low_text)))
    return spans


def expand_hostlist(expr: str) -> list[str]:
    """Slurm hostlist ``expr`` as ``scontrol show hostnames`` lists it: ``n[1-2],m`` -> n1, n2, m."""
    if not expr.strip():
        raise LaunchError("the hostlist is empty", fix="name at least one host: node1 or node[1-4]")
    parsed, total = [], 0
    for item in _items(expr):
        pieces = re.split(r"\[([^\]]*)\]", item)   # literal, group, literal, group, ..., literal
        if len(pieces) > 1 and pieces[-1]:
            raise LaunchError(f"hostlist {expr!r}: {pieces[-1]!r} follows the last ']' of {item!r}",
                              fix="end a bracketed item with ']' as Slurm does, or list the names: n1-ib,n2-ib")
        groups = [_group(text, expr) for text in pieces[1::2]]
        total += math.prod(sum(high - low + 1 for low, high, _ in spans) for spans in groups)
        if total > MAX_HOSTS:
            raise LaunchError(f"hostlist {expr!r} names more than {MAX_HOSTS} hosts (at {item!r})",
                              fix=f"check the ranges' bounds; a job spans at most {MAX_HOSTS} nodes")
        parsed.append((pieces[0::2], groups))
    hosts: list[str] = []
    for literals, groups in parsed:
        choices = [[f"{n:0{width}d}" for low, high, width in spans for n in range(low, high + 1)]
                   for spans in groups]
        # Slurm's order: the last group varies fastest, then the first, second, ... up to the
        # next-to-last, which varies slowest (a[1-2]b[3-4]c[5-6]: a1b3c5 a1b3c6 a2b3c5 ...).
        order = list(range(len(groups) - 2, -1, -1)) + [len(groups) - 1] if groups else []
        for combo in product(*(choices[i] for i in order)):
            numbers = dict(zip(order, combo))
            hosts.append(literals[0] + "".join(numbers[i] + lit for i, lit in enumerate(literals[1:])))
    twice = next((host for host, count in Counter(hosts).items() if count > 1), None)
    if twice is not None:
        raise LaunchError(f"hostlist {expr!r} names host {twice!r} more than once", fix="list each node once")
    return hosts


def _whole(env: Mapping[str, str], name: str) -> int | None:
    """``env[name]`` as a whole number, None when unset; anything else is refused."""
    text = env.get(name, "").strip()
    if text and not _DIGITS.fullmatch(text):
        raise LaunchError(f"{name}={env[name]!r} is not a whole number",
                          fix=f"run under srun, which sets {name}, or unset it")
    return int(text) if text else None


def from_slurm(env: Mapping[str, str]) -> NodeSource | None:
    """The job's nodes from Slurm's environment; None outside a Slurm allocation."""
    var = next((v for v in ("SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(v, "").strip()), None)
    if var is None:
        return None
    try:
        hosts = tuple(expand_hostlist(env[var]))
    except LaunchError as err:
        raise LaunchError(f"{var}: {err.problem}", fix=err.fix) from None
    nnodes = _whole(env, "SLURM_NNODES")
    if nnodes is not None and nnodes != len(hosts):
        raise LaunchError(f"SLURM_NNODES={nnodes} but {var}={env[var]} names {len(hosts)} hosts",
                          fix="run one srun task on every node of the allocation: "
                              "srun -N $SLURM_JOB_NUM_NODES --ntasks-per-node=1 hpct run ...")
    rank = _whole(env, "SLURM_NODEID")
    if rank is not None and rank >= len(hosts):
        raise LaunchError(f"SLURM_NODEID={rank} is outside the {len(hosts)} hosts of {var}={env[var]}",
                          fix="start hpct run with srun inside the allocation, not on another node")
    # SLURM_NTASKS_PER_NODE=1 is srun --ntasks-per-node=1: one agent per node, not one worker.
    tasks, gpus = (env.get(v, "").strip() for v in ("SLURM_NTASKS_PER_NODE", "SLURM_GPUS_ON_NODE"))
    nproc = int(tasks) if _DIGITS.fullmatch(tasks) and int(tasks) > 1 else \
        int(gpus) if _DIGITS.fullmatch(gpus) and int(gpus) > 0 else None
    return NodeSource(hosts, rank, nproc, var)


def from_pod_name(hostname: str, nnodes: int, service: str | None = None, *,
                  master: bool | None = None) -> NodeSource | None:
    """The job's pods from this pod's stable name (layouts: module docstring); None if none fits.

    ``service`` (a headless service) makes each name ``<pod>.<service>``.  ``master``: whether a
    PyTorchJob has a Master replica; None reads it from the name and ``MASTER_ADDR``."""
    if nnodes < 1:
        raise LaunchError(f"--nnodes {nnodes} is not a positive number of nodes", fix="give 1 or more")
    name = hostname.strip().split(".", 1)[0]
    if match := _OPERATOR_POD.fullmatch(name):
        job, index = match["job"], int(match["index"])
        if match["role"] == "master":
            if index != 0:
                raise LaunchError(f"pod {name!r} is master {index}, but a PyTorchJob has one master, "
                                  f"{job}-master-0", fix="set the Master replicas to 1 and scale the Workers")
            master = True
        elif master is None:
            master = os.environ.get("MASTER_ADDR", "").split(".", 1)[0] == f"{job}-master-0"
        rank = 0 if match["role"] == "master" else index + int(master)
        names = [f"{job}-master-0"] * int(master) + [f"{job}-worker-{i}" for i in range(nnodes - int(master))]
        layout = "master plus workers" if master else "workers only"
    elif match := _JOBSET_POD.fullmatch(name):
        if match["job"] != "0":
            raise LaunchError(f"pod {name!r} is in Job {match['job']} of its replicated job; hpct run "
                              "reads one indexed Job whose pods are the nodes (<job>-node-0-<i>)",
                              fix="give the replicated job 1 replica and parallelism = --nnodes, or --hosts")
        rank, layout = int(match["pod"]), "one indexed Job"
        names = [f"{match['stem']}-0-{i}" for i in range(nnodes)]
    else:
        return None
    if rank >= nnodes:
        raise LaunchError(f"pod {name!r} is node {rank} ({layout}), outside --nnodes {nnodes}",
                          fix="set --nnodes to the job's number of pods")
    suffix = f".{service.strip('.')}" if service and service.strip(".") else ""
    return NodeSource(tuple(n + suffix for n in names), rank, None, f"pod name {name}")


def from_hostfile(path: str | os.PathLike[str]) -> tuple[str, ...]:
    """One host per line; ``#`` starts a comment; ``host slots=N`` (MPI style) gives ``host``."""
    path = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise LaunchError(f"cannot read host file {path}: {why}",
                          fix="give a readable text file with one host name per line") from None
    hosts: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if words[0] in hosts:
            raise LaunchError(f"host file {path} names {words[0]!r} on lines {hosts[words[0]]} and {number}",
                              fix="list each node once (slots=N is ignored; --nproc-per-node sets workers)")
        hosts[words[0]] = number
    if not hosts:
        raise LaunchError(f"host file {path} names no hosts", fix="write one host per line (# starts a comment)")
    return tuple(hosts)


def check_hosts(hosts: NodeSource | Iterable[str], nnodes: int, source: str | None = None,
                spares: int = 0) -> tuple[str, ...]:
    """``hosts`` as a tuple, or a LaunchError when there are not exactly ``nnodes`` + ``spares``."""
    if isinstance(hosts, NodeSource):
        source, hosts = source or hosts.source, hosts.hosts
    hosts = tuple(hosts)
    if len(hosts) != nnodes + spares:
        counted = f"--nnodes {nnodes} plus --spare-nodes {spares}" if spares else f"--nnodes is {nnodes}"
        raise LaunchError(f"{source or 'the host list'} names {len(hosts)} host(s) but {counted}",
                          fix=f"pass --nnodes {len(hosts) - spares}, or a host list of {nnodes + spares} nodes"
                              + (" (the active nodes first, then the spares)" if spares else ""))
    return hosts
