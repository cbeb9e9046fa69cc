"""The harness behind ``hpct demo`` and ``benchmarks/``: a local cluster agent that starts,
kills and replaces ranks (agent), the training rank it runs (trainer) and the timing runs
(measure).  Not imported by ``hpct.distributed``: a training job needs none of it.
"""
