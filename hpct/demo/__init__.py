"""The harness behind ``hpct demo`` and ``benchmarks/``: the demo's job under ``hpct run``
(launched), the training rank it runs (trainer), the timing runs (measure), and a local cluster
agent that starts, kills and replaces ranks on a test's cue (agent, for the tests and benchmarks).
Not imported by ``hpct.distributed``: a training job needs none of it.
"""
