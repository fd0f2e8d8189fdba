"""The cluster detectors (`torchpass detect kubernetes|slurm`) and the spare-node keepers they run.
They speak to jobs over their control channels, never to Temporal."""
