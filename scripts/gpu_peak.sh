#!/usr/bin/env bash
# The dense bf16 peak, in TFLOPS, of the card nvidia-smi names CARD (NVIDIA's
# data sheets), for scripts/gpu_bench.sh's MFU: the PCIe and NVL cards run
# slower than the SXM ones that nvidia-smi names plainly. 0 for a card not
# listed (no MFU).
#
#   scripts/gpu_peak.sh "NVIDIA H100 80GB HBM3"   # 989
set -euo pipefail
case "${1:?usage: scripts/gpu_peak.sh CARD}" in
  *H100*PCIe*) echo 756 ;;
  *H100*NVL* | *H200*NVL*) echo 835 ;;
  *H100* | *H200*) echo 989 ;;
  *A100*) echo 312 ;;
  *) echo 0 ;;
esac
