"""The update outside JAX: the ONNX nodes (slot contract, Edge-LLM 0.11's paged node), ONNX
export, the ONNX reference runtime, TensorRT."""
