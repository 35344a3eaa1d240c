"""Export of a personalized AdapEmu: a merged Hugging Face folder, ONNX with KV cache, int8.

``export`` imports ``ciders_edge`` (model assembly, the export-folder format), never the reverse:
its commands join ``ciders-edge`` through the ``ciders_edge.commands`` entry-point group.
"""

__all__ = ["export_model"]


def __getattr__(name: str):
    """``export.export_model`` on first use: the commands' module (``export.cli``) loads with every
    ``ciders-edge`` call, and the model stack behind this must not."""
    if name == "export_model":
        from export.api import export_model

        return export_model
    raise AttributeError(f"module 'export' has no attribute {name!r}")
