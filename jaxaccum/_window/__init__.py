"""The window every front end shares: its spec, the split, one micro-batch,
the scan, its sums and their normalisation, FSDP gathers, the call checks."""
