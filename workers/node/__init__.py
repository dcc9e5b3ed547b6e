"""The node: a worker assembled from its engine and queue rooms, and run."""
