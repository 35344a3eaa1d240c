"""Device profiles shipped as TOML package data; read them with ``ciders_edge.profiles``."""
