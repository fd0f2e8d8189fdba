"""Incident execution in the coordinator: the incident in progress and its steps, carried out for
the workflow or by the job itself."""
