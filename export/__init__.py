"""Export of a personalized AdapEmu (merged Hugging Face folder, ONNX, int8).

Not built yet (issue 5): the package exists so the layout and the import direction
(``export`` imports ``ciders_edge``, never the reverse) are fixed from the start.
"""
