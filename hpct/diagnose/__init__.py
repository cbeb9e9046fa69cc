"""``hpct diagnose``: which link is slow, which setting differs, which rank never arrived.

Run on every rank of the job, launched as the training job is (``torchrun``, ``srun``, one
process per rank), as ``hpct diagnose`` or ``python -m hpct.diagnose``.  docs/diagnose.md
says how to read the report.
"""
