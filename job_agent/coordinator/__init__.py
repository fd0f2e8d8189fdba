"""The per-job coordinator process: the job's processes, its control channel, its incidents. No
torch."""
