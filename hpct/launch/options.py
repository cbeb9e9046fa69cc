"""``hpct run``'s command line: torchrun's flags with the word changed, checked into one frozen
``RunOptions``.

torchrun's rendezvous flags (``--master-addr`` and friends) are accepted and reported as
unused: hpct's agents find each other from the host list and the port plan.  A torchrun flag
hpct cannot honour is refused by name; anything else is argparse's usual error.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..config import Config
from ..errors import LaunchError
from .links import SLOW_FACTOR

# Accepted for compatibility; the agents need none of them (no store, no root).
UNUSED_FLAGS = ("--master-addr", "--master-port", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-conf",
                "--start-method", "--monitor-interval", "--role")
# torchrun flags with no hpct meaning: refused by name rather than half honoured.
REFUSED_FLAGS = {
    "--tee": "workers' output always goes to their log files (--log-dir); read them there",
    "--redirects": "workers' output always goes to their log files (--log-dir)",
    "--local-ranks-filter": "every worker's output goes to its own log file (--log-dir)",
    "--logs-specs": "hpct run writes per-worker logs itself (--log-dir)",
    "--local-addr": "each node's address comes from the host list (--hosts, a host file or Slurm)",
    "--max-nodes": "give --nnodes a single number; membership changes are replace, shrink and grow",
    "--numa-binding": "bind inside the script (os.sched_setaffinity) or with numactl --no-python",
    "--event-log-handler": "use --json FILE for hpct run's event log",
    "--signals-to-handle": "hpct run handles SIGTERM and SIGINT",
    "--virtual-local-rank": "LOCAL_RANK is the process's place on its node",
}
DEFAULT_GRACE_S = 5.0          # an agent silent this long is a lost node
# A worker stopped by a signal this long is killed and replaced (health.py's stopped_past): every
# collective of the job waits on it meanwhile, and a stop of a second or two still rides through.
DEFAULT_STOPPED_GRACE_S = 3.0
STOP_GRACE_S = 10.0            # SIGTERM to workers, then SIGKILL after this
# A node whose agent's asks take longer than this (and SLOW_FACTOR times the rest of the job's) gives
# its slot to a spare (links.py).  Asks inside a data centre take well under 1 ms; 10 ms is a link gone bad.
DEFAULT_SLOW_LINK_MS = 10.0


def _spellings(flag: str) -> list[str]:
    """torchrun takes both --nproc-per-node and --nproc_per_node."""
    if not flag.startswith("--"):
        return [flag]
    under = "--" + flag[2:].replace("-", "_")
    return [flag] if under == flag else [flag, under]


class _Refuse(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        namespace.refused.append(self.dest[len("refuse"):])


class _Unused(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        namespace.unused.append(option_string)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.set_defaults(refused=[], unused=[])
    def add(*flags: str, **kw) -> None:
        p.add_argument(*[s for f in flags for s in _spellings(f)], **kw)

    add("--nnodes", default=None, help="number of nodes (default: the host list's length, else 1; "
        "torchrun's MIN:MAX ranges are refused)")
    add("--nproc-per-node", default=None, help="workers per node (default: Slurm's count, else 1)")
    add("--node-rank", type=int, default=None, help="this node's rank (default: SLURM_NODEID, "
        "the pod's index, or the host list entry that is an address of this machine)")
    add("--max-restarts", type=int, default=None,
        help="times one rank's own failure (non-zero exit) is retried; a killed worker is always replaced")
    add("--rdzv-id", "--run-id", dest="run_id", default=None,
        help="the job's identity, equal on every agent (default: SLURM_JOB_ID, else 'none')")
    add("--standalone", action="store_true", help="one node on this machine")
    add("-m", "--module", dest="module", action="store_true", help="run the script as a module")
    add("--no-python", dest="no_python", action="store_true", help="run the script as a program")
    add("--hosts", default=None, help="node addresses, node 0 first: a comma list or a Slurm hostlist")
    add("--hostfile", default=None, help="file with one node address per line")
    add("--standby", type=int, default=0, help="warm standby processes per node (torch imported), kept with "
        "--no-fork-server or once the node's fork server has ended")
    add("--fork-server", dest="fork_server", action="store_true", default=None,
        help="fork each worker from one process per node that imported torch once (the default for a Python script)")
    add("--no-fork-server", dest="fork_server", action="store_false", default=None,
        help="start an interpreter per worker, which imports torch itself (--standby K then keeps K warm standbys)")
    add("--spare-nodes", type=int, default=0, help="spare nodes listed after the active ones: one takes a "
        "lost node's place (its ranks), and a node that comes back after a shrink joins by grow")
    add("--port-base", type=int, default=None, help="HPCT_PORT_BASE for the job's port plan")
    add("--node-grace", type=float, default=DEFAULT_GRACE_S, help="seconds of silence that make a node lost")
    add("--stopped-grace", type=float, default=DEFAULT_STOPPED_GRACE_S, help="seconds a worker may stay "
        "stopped by a signal (SIGSTOP, SIGTSTP) before it is killed and replaced; 0: its peers wait for it "
        "until their op timeout")
    add("--slow-link-ms", type=float, default=DEFAULT_SLOW_LINK_MS, help="a node whose links are this slow "
        f"(the median agent ask, in ms) and {SLOW_FACTOR:g}x slower than the rest gives its ranks to an idle spare "
        "node; 0: never")
    add("--log-dir", default=None, help="folder for per-worker logs (default: a new temporary folder)")
    add("--json", dest="json_log", default=None, help="write the event log as JSON lines to this file")
    for flag in UNUSED_FLAGS:
        add(flag, action=_Unused, default=None, help=argparse.SUPPRESS)
    for flag in REFUSED_FLAGS:
        add(flag, dest=f"refuse{flag}", action=_Refuse, nargs="?", help=argparse.SUPPRESS)
    p.add_argument("training_script", help="the script (or module with -m, program with --no-python)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)


@dataclass(frozen=True)
class RunOptions:
    """Everything one node's agent needs, checked."""

    nnodes: int
    nproc_per_node: int
    node_rank: int
    hosts: tuple[str, ...]
    host_source: str
    run_id: str
    max_restarts: int
    standby: int
    fork_server: bool                 # forkserver.py: workers forked from one warm process per node
    spare_nodes: int                  # host list entries after the nnodes active ones
    command: tuple[str, ...]          # the worker's argv
    python_script: bool               # standbys can run it (not --no-python)
    log_dir: Path
    json_log: Path | None
    node_grace: float
    stopped_grace: float              # health.py's stopped_past; 0: a stopped worker is waited for
    slow_link_ms: float               # links.py; 0: a slow node keeps its slot
    port_env: tuple[tuple[str, str], ...]   # HPCT_PORT_BASE etc. for the workers, when given
    unused: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def all_nodes(self) -> int:
        """Active and spare nodes: the host list's length."""
        return self.nnodes + self.spare_nodes

    @classmethod
    def from_mapping(cls, args: Mapping, env: Mapping[str, str]) -> "RunOptions":
        args = _with_pet_defaults(args, env)
        if args.get("refused"):
            flag = args["refused"][0]
            raise LaunchError(f"hpct run cannot honour torchrun's {flag}", fix=REFUSED_FLAGS[flag])
        nnodes = _count("--nnodes", args["nnodes"], "a number of nodes such as 2") if args.get("nnodes") else None
        spares = args.get("spare_nodes") or 0
        if spares < 0:
            raise LaunchError(f"--spare-nodes {spares} is negative", fix="give 0 or more")
        hosts, source, slurm_rank, slurm_nproc = _hosts(args, env, nnodes, spares)
        nnodes = nnodes or len(hosts) - spares
        if nnodes < 1:
            raise LaunchError(f"--spare-nodes {spares} leaves no active node of the {len(hosts)} listed",
                              fix="list the active nodes first, then the spares, and give --nnodes")
        nproc = args.get("nproc_per_node")
        nproc = _count("--nproc-per-node", nproc, "a number of workers such as 8") if nproc else (slurm_nproc or 1)
        node_rank = args.get("node_rank")
        node_rank = node_rank if node_rank is not None else slurm_rank
        if node_rank is None:
            node_rank = 0 if len(hosts) == 1 else _local_node(hosts, source)
        if not 0 <= node_rank < nnodes + spares:
            raise LaunchError(f"--node-rank {node_rank} is not below --nnodes {nnodes}"
                              f"{f' plus --spare-nodes {spares}' if spares else ''}",
                              fix=f"give each node's agent a rank from 0 to {nnodes + spares - 1}")
        for name in ("max_restarts", "standby", "slow_link_ms", "stopped_grace"):
            if args.get(name, 0) < 0:
                raise LaunchError(f"--{name.replace('_', '-')} {args[name]} is negative", fix="give 0 or more")
        script = args["training_script"]
        fork_server = args.get("fork_server")
        if args.get("no_python"):
            for flag in ("standby", "fork_server"):
                if args.get(flag):
                    raise LaunchError(f"--{flag.replace('_', '-')} needs a Python script: it runs the script in "
                                      "a Python process that imported torch already",
                                      fix=f"drop --no-python or --{flag.replace('_', '-')}")
            command = (script,)
        elif args.get("module"):
            command = ("-m", script)
        else:
            if not os.path.isfile(script):
                raise LaunchError(f"the training script {script!r} does not exist",
                                  fix="give the script's path (or -m MODULE, or --no-python PROGRAM)")
            command = (os.path.abspath(script),)
        port_env = (("HPCT_PORT_BASE", str(args["port_base"])),) if args.get("port_base") else ()
        run_id = args.get("run_id") or env.get("SLURM_JOB_ID") or "none"
        log_dir = Path(args.get("log_dir") or tempfile.mkdtemp(prefix=f"hpct-run-{run_id}-"))
        json_log = Path(args["json_log"]) if args.get("json_log") else None
        return cls(nnodes=nnodes, nproc_per_node=nproc, node_rank=node_rank, hosts=hosts, host_source=source,
                   run_id=run_id, max_restarts=args.get("max_restarts", 0), standby=args.get("standby", 0),
                   # The default for a Python script: a worker lost at any time, its first seconds
                   # included, is forked warm (docs/launch.md, "Forked workers").
                   fork_server=not args.get("no_python") if fork_server is None else fork_server,
                   spare_nodes=spares,
                   command=command + tuple(args.get("training_script_args") or ()),
                   python_script=not args.get("no_python"), log_dir=log_dir.resolve(), json_log=json_log,
                   node_grace=float(args.get("node_grace", DEFAULT_GRACE_S)),
                   stopped_grace=float(args.get("stopped_grace", DEFAULT_STOPPED_GRACE_S)),
                   slow_link_ms=float(args.get("slow_link_ms", DEFAULT_SLOW_LINK_MS)), port_env=port_env,
                   unused=tuple(args.get("unused") or ()))


# torchrun reads PET_<FLAG> for a flag not given; Kubeflow's PyTorchJob and Trainer v2 set these.
PET_DEFAULTS = {"nnodes": "PET_NNODES", "nproc_per_node": "PET_NPROC_PER_NODE", "node_rank": "PET_NODE_RANK",
                "max_restarts": "PET_MAX_RESTARTS", "run_id": "PET_RDZV_ID"}


def _with_pet_defaults(args: Mapping, env: Mapping[str, str]) -> dict:
    merged = dict(args)
    for key, var in PET_DEFAULTS.items():
        if merged.get(key) is None and env.get(var):
            raw = env[var]
            if key in ("node_rank", "max_restarts"):
                if not raw.isdigit():
                    raise LaunchError(f"{var}={raw!r} is not a whole number", fix=f"set {var} to 0 or more")
                raw = int(raw)
            merged[key] = raw
    merged.setdefault("max_restarts", 0)
    if merged["max_restarts"] is None:
        merged["max_restarts"] = 0
    return merged


def _count(flag: str, raw, example: str) -> int:
    text = str(raw)
    if ":" in text:
        raise LaunchError(f"{flag} {text}: hpct run takes one number, not torchrun's MIN:MAX range",
                          fix=f"give {example}; a job changes size by replace, shrink and grow (docs/launch.md)")
    if not text.isdigit() or int(text) < 1:
        raise LaunchError(f"{flag} {text!r} is not a positive whole number", fix=f"give {example}")
    return int(text)


def _hosts(args: Mapping, env: Mapping[str, str], nnodes: int, spares: int = 0):
    """(hosts, where they came from, the scheduler's node rank, the scheduler's workers per node)."""
    from . import hosts as sources
    if args.get("standalone"):
        if nnodes not in (None, 1):
            raise LaunchError(f"--standalone runs one node, but --nnodes is {nnodes}", fix="drop one of them")
        return ("127.0.0.1",), "--standalone", 0, None
    if args.get("hosts") and args.get("hostfile"):
        raise LaunchError("both --hosts and --hostfile are given", fix="give one host list")
    found, rank, nproc = None, None, None
    if args.get("hosts"):
        found, source = tuple(sources.expand_hostlist(args["hosts"])), "--hosts"
    elif args.get("hostfile"):
        found, source = tuple(sources.from_hostfile(args["hostfile"])), f"host file {args['hostfile']}"
    elif env.get("HPCT_HOSTS") or env.get("HPCT_HOSTFILE"):
        # hpct's own variables: read by Config, with the rules every other part of hpct applies.
        names = ("HPCT_HOSTS", "HPCT_HOSTFILE")
        found = Config.from_mapping({k: env[k] for k in names if env.get(k)}).hosts
        source = next(f"{k}={env[k]}" for k in names if env.get(k))
    elif (slurm := sources.from_slurm(env)) is not None:
        found, source, rank, nproc = slurm.hosts, slurm.source, slurm.node_rank, slurm.nproc_per_node
    elif env.get("KUBERNETES_SERVICE_HOST") and \
            (pod := sources.from_pod_name(socket.gethostname(), (nnodes or 1) + spares)) is not None:
        found, source, rank = pod.hosts, pod.source, pod.node_rank
    elif nnodes in (None, 1):
        return ("127.0.0.1",), "one node", 0, None
    else:
        raise LaunchError(f"--nnodes {nnodes} needs the nodes' addresses",
                          fix="give --hosts a,b,... or --hostfile FILE (under Slurm they come from "
                              "SLURM_JOB_NODELIST)")
    if nnodes is not None:
        sources.check_hosts(found, nnodes, source, spares)
    return found, source, rank, nproc


def _local_node(hosts: tuple[str, ...], source: str) -> int:
    """The one host list entry that is an address of this machine (a test bind says so)."""
    mine = [i for i, h in enumerate(hosts) if _is_local(h)]
    if len(mine) == 1:
        return mine[0]
    if not mine:
        raise LaunchError(f"no entry of the host list ({source}: {', '.join(hosts)}) is an address of this "
                          "machine", fix="give --node-rank, or list this node's own address")
    raise LaunchError(f"entries {mine} of the host list ({source}) are all addresses of this machine",
                      fix="give --node-rank to say which node this agent is")


def _is_local(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False
