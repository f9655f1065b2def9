"""The engine process and the edge workers' link to it (docs/architecture.md, "Processes")."""
