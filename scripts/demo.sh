#!/usr/bin/env bash
# Set up, then run the demo: analyse the bundled sales data in a sandbox and
# write a chart and a summary to out/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/sales_demo.py --out out/demo "$@"
