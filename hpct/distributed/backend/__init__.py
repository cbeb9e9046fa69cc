"""The c10d backend torch sees: the process-group facade (group.py), its argument checks, and the Gloo engine that serves CPU tensors (gloo_engine.py, ops.py, runner.py, work.py)."""
