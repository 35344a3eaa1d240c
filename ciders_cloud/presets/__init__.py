"""Run configurations shipped with the package (``--config NAME``)."""
