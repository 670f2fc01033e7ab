"""Acoustic models: flat parameter buffers (flat), element-wise kernels (kernels), the DNN (dnn)."""
