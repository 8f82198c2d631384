"""Prefill/decode disaggregation: a decode engine has prompts prefilled on prefill nodes, which push the KV
pages (K, V, FP8 scales, index keys) over a KV transport (UCX) while gRPC carries the control messages."""
