"""Triton kernels for MiniMax-M3, each beside its plain-torch reference. Never imports m3sdk."""
