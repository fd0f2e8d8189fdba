"""Processes: the control worker, the job worker inside each coordinator."""
