"""One cloud round: packet intake, reconstruction and aggregation (eq. 11–13), the next bundles."""
