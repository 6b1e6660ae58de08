"""ONNX export of dense segments and the onnxruntime / TensorRT backends that run them."""
