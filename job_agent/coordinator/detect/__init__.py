"""Detection in the coordinator: what its members, node agents, operators and cluster detectors
say, turned into evidence of an incident."""
