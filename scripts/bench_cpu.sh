#!/usr/bin/env bash
# The CPU benchmarks the README quotes: SmolLM2-135M with bf16 weights, every cache dtype side by side in
# one run per mode. Run it on an idle machine (check `uptime`); each JSON records the load average before
# and after. About 50 minutes on 2 cores without bf16 matrix hardware (linears in fp32, qkv/cpu_linear.py).
set -euo pipefail
cd "$(dirname "$0")/.."
QKV=${QKV:-.venv/bin/qkv}
OUT=${OUT:-eval/results/bench}
# static int8: minmax per-tensor scales calibrated on WikiText-2 validation (qkv eval --search)
INT8=eval/results/smollm2-search/scales/int8-tensor-none.safetensors
DTYPES="bf16,fp8,int8:$INT8,int8_per_token_head"
mkdir -p "$OUT"
uptime
# the decode-heavy budget row (issue 23): 48 x (128 + 256) at 96 MiB, where twice the KV capacity can show
"$QKV" bench smollm2-135m --mode throughput --kv-cache-dtypes "$DTYPES" --num-requests 48 --prompt-len 128 \
  --output-len 256 --kv-cache-memory 96MiB --max-num-seqs 64 --repeats 3 --fits-all -o "$OUT/throughput_smollm2.json"
"$QKV" bench smollm2-135m --mode latency --kv-cache-dtypes "$DTYPES" --batch-sizes 1,16 --prompt-len 256 \
  --output-len 32 --repeats 2 -o "$OUT/latency_smollm2.json"
# batch-16 decode alone, longer and repeated more: the run above varies by +-15 % from run to run here
"$QKV" bench smollm2-135m --mode latency --kv-cache-dtypes "$DTYPES" --batch-sizes 16 --prompt-len 256 \
  --output-len 96 --repeats 5 --no-transformers -o "$OUT/decode16_smollm2.json"
"$QKV" bench smollm2-135m --mode prefix --kv-cache-dtypes "$DTYPES" --prefix-len 2048 --repeats 2 \
  -o "$OUT/prefix_smollm2.json"
# offload tier (issue 16): a 2,048-token prefix evicted from the device pool, then requested again; tier-hit
# TTFT against cold, bf16 and fp8, the tier in RAM (+ram) and in files (+file) side by side in one run
TIER_DIR=$(mktemp -d)
"$QKV" bench smollm2-135m --mode prefix --kv-cache-dtypes bf16,fp8 --prefix-len 2048 --repeats 3 \
  --kv-offloading-size 1 --kv-offloading-backend native --kv-offloading-dir "$TIER_DIR" \
  -o "$OUT/prefix_offload_smollm2.json"
# the write-through tier's cost (issue 26): the budget row with prefix caching on, each dtype without a tier
# and with one in RAM and in files, side by side; ratio_to_tier_off per tier engine
"$QKV" bench smollm2-135m --mode throughput --kv-cache-dtypes bf16,fp8 --num-requests 48 --prompt-len 128 \
  --output-len 256 --kv-cache-memory 96MiB --max-num-seqs 64 --repeats 3 \
  --kv-offloading-size 1 --kv-offloading-backend native --kv-offloading-dir "$TIER_DIR" \
  -o "$OUT/throughput_offload_smollm2.json"
rm -rf "$TIER_DIR"
uptime
