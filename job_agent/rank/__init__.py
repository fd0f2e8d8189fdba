"""The rank side: what runs inside each training process (and each warm spare). Imports torch."""
