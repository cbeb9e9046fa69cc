"""The harness the test suite and benchmarks/ share, installed with hpct so both import it by name:
network namespaces (netns.py), the lossy switch (lossy.py), hpct run clusters (cluster.py), the
simulated NCCL and CUDA runtime (nccl_sim/) and process helpers (procs.py).  Never imported by the
runtime (tests/test_layout.py)."""
