"""The update outside JAX: the ONNX node, ONNX export, the ONNX reference runtime, TensorRT."""
