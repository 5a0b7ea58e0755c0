"""One module per cache format: its constants, its checks, its oracle rows, its array-op store, and the backend
rows that implement it."""
