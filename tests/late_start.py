"""Runs a training script (argv[1], with the rest of argv) after ``HPCT_TEST_LATE_START_S`` seconds,
in a worker started at generation 0 only: a node whose workers are slow to start (a starved node
importing torch), so that the agents' view moves on before the job's first world forms."""

import os
import runpy
import sys
import time

if os.environ.get("HPCT_GENERATION", "0") == "0":
    time.sleep(float(os.environ.get("HPCT_TEST_LATE_START_S", "0")))
sys.argv = sys.argv[1:]
# The script runs as python runs one, its own folder first on sys.path (as hpct run's forked and
# standby workers do too): examples/*.py import their shared end from beside them (_common.py).
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
