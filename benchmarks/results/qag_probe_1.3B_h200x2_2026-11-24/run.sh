#!/bin/bash
# Session 13, x2 probe: 1.3B FSDP2 on two H200s, fp8-tensorwise with and without the quantized
# weight all-gather (byte tokenizer: no BPE training in the call), trainer tokens/s.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi -L | tee $OUT/gpus.txt
for qag in "--quantized-all-gather" ""; do
  tag=qag$([ -n "$qag" ] && echo 1 || echo 0)
  timeout 170 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m minifloat train \
    --model 1.3B --recipe fp8-tensorwise --parallel fsdp $qag --steps 25 --batch-size 8 --seq-len 2048 \
    --data .carry/english.xz --tokenizer byte --log-every 5 --eval-every 1000 --eval-batches 1 \
    --compile --compile-scope block --ckpt-format sharded --out /tmp/x2_$tag 2>&1 | grep -E "step|tokens|Error|error" | tail -8 | tee $OUT/$tag.txt
  cp /tmp/x2_$tag/metrics.jsonl $OUT/$tag.metrics.jsonl 2>/dev/null
done
