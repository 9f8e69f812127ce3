"""`delta` as a backend of vLLM's own weight-transfer framework: a door over the transaction core."""
