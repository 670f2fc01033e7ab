#!/usr/bin/env bash
set -u
i=0
for side in abmain base abmain base base abmain base abmain; do
  i=$((i+1))
  cd /work/$side
  .venv/bin/hpcsgd bench exchange --ranks 2 --codecs onebit,float32 --repeats 9 \
      --json /work/ab/ab8_exchange_${i}_${side}.json > /work/ab/ab8_exchange_${i}_${side}.log 2>&1
done
echo AB8-DONE
