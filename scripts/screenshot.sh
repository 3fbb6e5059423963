#!/usr/bin/env bash
# Render an eval report in headless Chromium and save a PNG of it, to check what a reader sees.
# usage: scripts/screenshot.sh REPORT_HTML OUT_PNG [WIDTH,HEIGHT]
# Needs Debian's chromium (apt-get update && apt-get install -y chromium); nothing is fetched.
set -euo pipefail
html=$(realpath "$1")
out=$(realpath -m "$2")
size=${3:-1400,2400}
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
chromium --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
  --no-first-run --user-data-dir="$profile" --hide-scrollbars --window-size="$size" \
  --screenshot="$out" "file://$html" 2>/dev/null
echo "wrote $out"
