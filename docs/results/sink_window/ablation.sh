#!/bin/bash
# issue 7: sink/window ablation on SmolLM2 layers 4,12,20 (CPU budget: 100 updates, pool 64, 128 validation positions, 1 thread)
set -x
export OAL_DATA_DIR=/work/shared/data
cd "$(dirname "$0")/../../.."  # repository root
O=.venv/bin/oal
C=runs/paper/calibrate64
A=runs/paper/sinkwindow
B="--layers 4,12,20 --seq-len 4096 --train-pool 64 --max-updates 100 --patience 100 --val-positions 128 --threads 1 --cache runs/qkv"
cal() { /usr/bin/time -f "%e s wall %U s user" $O calibrate "$@" $B 2>&1 | tail -2; }
cal --kernel oal+sink --n-sink 1 --groups runs/paper/group/groups.json --init-from $C/oal --out $A/s1w0
cal --kernel oal+sink --n-sink 4 --groups runs/paper/group/groups.json --init-from $C/oal --out $A/s4w0
cal --kernel oal+window --window 16 --groups runs/paper/group/groups.json --init-from $C/oal --out $A/s0w16
cal --kernel oal+window --window 64 --groups runs/paper/group/groups.json --init-from $C/oal --out $A/s0w64
cal --kernel oal+sink+window --n-sink 1 --window 16 --groups runs/paper/group/groups.json --init-from $C/oal --out $A/s1w16
cal --kernel oal+sink+window --n-sink 1 --window 64 --groups runs/paper/group/groups.json --init-from $C/oal --out $A/s1w64
cal --kernel oal+sink+window --n-sink 4 --window 16 --groups runs/paper/group/groups.json --init-from $C/oal --out $A/s4w16
cal --kernel oal+sink+window --n-sink 4 --window 64 --groups runs/paper/group/groups.json --init-from $C/oal --out $A/s4w64
cal --kernel global+sink+window --n-sink 4 --window 64 --init-from $C/oal/global --out $A/global_s4w64
$O fidelity --out runs/paper/fidelity_sinkwindow --cache runs/qkv --calibrated $C \
  -m softmax -m global -m "oal" -m "s1w0:oal+sink=$A/s1w0" -m "s4w0:oal+sink=$A/s4w0" \
  -m "s0w16:oal+window=$A/s0w16" -m "s0w64:oal+window=$A/s0w64" -m "s1w16:oal+sink+window=$A/s1w16" \
  -m "s1w64:oal+sink+window=$A/s1w64" -m "s4w16:oal+sink+window=$A/s4w16" -m "s4w64:oal+sink+window=$A/s4w64" \
  -m "global_s4w64:global+sink+window=$A/global_s4w64" 2>&1 | tail -30
