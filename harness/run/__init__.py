"""Run control: one controller drives a target through a run; supervision, recovery, the run record, status."""
