"""The node agent process (`torchpass node`): one per host of a multi-node job. No torch."""
