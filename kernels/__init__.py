"""Cache-write and paged-attention kernels (Triton) with torch references. Installed as qkv.kernels."""
