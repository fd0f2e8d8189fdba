"""Starting a job's processes on a host: the launcher and the fork server. Used by the coordinator
and the node agent alike."""
