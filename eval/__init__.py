"""Accuracy and latency evaluation against the BF16 paged baseline (qkv eval). Installed as qkv.eval."""
