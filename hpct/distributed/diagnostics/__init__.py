"""Where a job's communication time goes: DDP's gradient communication per step, hidden and exposed (profile_comm.py)."""
