"""``hpct ports plan|apply|check``: show the port plan, make the kernel fit it, or verify that it does."""

from __future__ import annotations

import argparse

from .cliutil import print_json
from .errors import PortPlanError


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("plan", "apply", "check"),
                        help="plan: print the blocks and ports of this configuration; "
                             "apply: set the ephemeral floor and reserve the blocks that need it; "
                             "check: exit non-zero if the plan conflicts with the live kernel values")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--dry-run", action="store_true",
                        help="apply: print the exact writes (as sysctl -w commands) without doing them")
    parser.add_argument("--ephemeral-floor", type=int, default=None, metavar="PORT",
                        help="apply: the low end of ip_local_port_range to set (default 20000)")
    # Tests point this at a temporary tree; real use is always the namespace's own /proc/sys.
    parser.add_argument("--proc-sys", default=None, help=argparse.SUPPRESS)


def _plan():
    from .config import Config
    from .ports import PortPlan
    config = Config.from_mapping()
    return config, PortPlan.from_config(config)


# What a one-host user needs to know when nothing says how many processes a node runs.
NPROC_LATER = ("; on the default single host init_process_group's world size sets it, so "
               "init_process_group('hpct', rank=r, world_size=n) needs no hpct variable")


def _local_ranks(config) -> list[int]:
    return [config.local_rank] if config.local_rank is not None else list(range(config.nproc_per_node))


def _show_plan(config, plan, as_json: bool) -> int:
    ports = {b: {l: plan.local_ports(b, l) for l in _local_ranks(config)} for b, _ in plan.bases}
    if as_json:
        print_json({"plan": plan.as_dict(),
                    "listen_ports": {b: {str(l): p for l, p in by_rank.items()} for b, by_rank in ports.items()},
                    "hpct_gloo_ports": {str(l): plan.shared_port("gloo", l) for l in _local_ranks(config)}})
        return 0
    from .config import NPROC_DEFAULT, nproc_source
    source = nproc_source()
    print(f"hosts:  {', '.join(plan.hosts)} ({len(plan.hosts)} node(s) x {plan.nproc_per_node} "
          f"process(es), world size {plan.world_size}; processes per node from {source}"
          f"{NPROC_LATER if source == NPROC_DEFAULT else ''})")
    print(f"slots:  {plan.slots} (NCCL communicators alive at once per process, and the patched-PyTorch "
          f"track's ProcessGroupGloo groups; group g uses slot g mod {plan.slots})")
    shared = ", ".join(f"local rank {l}: {plan.shared_port('gloo', l)}" for l in _local_ranks(config))
    print(f"hpct backend, Gloo: every group of a process on one port, B + l (any number alive): {shared}")
    for backend, by_rank in ports.items():
        block = plan.block(backend)
        print(f"{backend}:   block {block.start}-{block.stop - 1}")
        for l, p in by_rank.items():
            print(f"  local rank {l}: {', '.join(map(str, p))}")
    return 0


def _apply(plan, args) -> int:
    from .sysctl import DEFAULT_EPHEMERAL_FLOOR, Sysctl, apply
    sysctl = Sysctl(args.proc_sys) if args.proc_sys else Sysctl()
    floor = DEFAULT_EPHEMERAL_FLOOR if args.ephemeral_floor is None else args.ephemeral_floor
    blocks = [plan.block(b) for b, _ in plan.bases]
    writes = apply(sysctl, blocks, floor=floor, dry_run=args.dry_run)
    if args.json:
        print_json({"dry_run": args.dry_run, "ephemeral_floor": floor,
                    "writes": [{"name": w.name, "value": w.value, "command": w.command} for w in writes]})
    elif not writes:
        print(f"nothing to do: the ephemeral floor is {floor} and every block port is safe")
    else:
        print("would run (dry run):" if args.dry_run else "done (written and read back):")
        for w in writes:
            print(f"  {w.command}")
    return 0


def _check(plan, args) -> int:
    from .ports import check_plan
    from .sysctl import Sysctl
    sysctl = Sysctl(args.proc_sys) if args.proc_sys else Sysctl()
    port_range, reserved = sysctl.port_range(), sysctl.reserved_ports()
    problems = check_plan(plan, port_range, reserved)
    if args.json:
        print_json({"ok": not problems, "port_range": list(port_range),
                    "problems": [{"backend": p.backend, "message": p.message, "fix": p.fix} for p in problems]})
    elif not problems:
        print(f"ok: no port of the plan lies in the unreserved ephemeral range {port_range[0]}-{port_range[1]}")
    if problems:
        raise PortPlanError("; ".join(p.message for p in problems), fix=problems[0].fix)
    return 0


def execute(args: argparse.Namespace) -> int:
    config, plan = _plan()
    if args.action == "plan":
        return _show_plan(config, plan, args.json)
    if args.action == "apply":
        return _apply(plan, args)
    return _check(plan, args)
