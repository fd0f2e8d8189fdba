"""An incident's core: how a failure is classified, what each job-side step takes and answers, the
outcome it ends in and the proof that outcome must hold. Pure."""
