"""CIDERS edge runtime: bundle and packet formats, AdapEmu assembly, the edge update, inference."""

__version__ = "0.1.0"
