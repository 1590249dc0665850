"""Generators of quantized LLM ONNX graphs in the patterns real exporters and quantizers write."""
