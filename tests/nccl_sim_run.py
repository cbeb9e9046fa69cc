"""Run a module with the NCCL simulation switched on: ``python tests/nccl_sim_run.py -m MODULE ARGS...``.

The test-only switch (nccl_sim.install): every hpct group the module makes routes its CPU
tensors to the NCCL engine over the simulated library and runtime.  Faults come from
SIM_NCCL_JITTER (seconds a library call is held open, at most) and SIM_NCCL_LAUNCH_POLLS.
"""

import os
import runpy
import sys

from hpct.testing import nccl_sim

if len(sys.argv) < 3 or sys.argv[1] != "-m":
    sys.exit("usage: python tests/nccl_sim_run.py -m MODULE [ARGS...]")
nccl_sim.install(jitter=float(os.environ.get("SIM_NCCL_JITTER", "0") or 0),
                 launch_polls=int(os.environ.get("SIM_NCCL_LAUNCH_POLLS", "2") or 2))
module = sys.argv[2]
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
