"""Lowering graph nodes to D-Legion instructions; one module per family of ONNX ops."""
