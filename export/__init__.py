"""Export of a personalized AdapEmu to a merged Hugging Face folder and ONNX (issue 5)."""
