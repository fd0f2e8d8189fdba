"""Development tools: the live-migration demo, the embedded dev server, a reference billing
receiver."""
