"""A run on disk: its folder's layout, its config, the server state, the lock that keeps one writer."""
