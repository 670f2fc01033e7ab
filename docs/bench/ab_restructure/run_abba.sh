#!/usr/bin/env bash
# A/B in one run, ABBA order (cancels a drift of the machine): bench exchange and bench train
# of aa94bde (/work/base, before the restructure) and 65aab65 (/work/abmain, after it).
set -u
i=0
for side in base abmain abmain base; do
  i=$((i+1))
  cd /work/$side
  .venv/bin/hpcsgd bench exchange --ranks 2 --codecs onebit,kbit4,float32 \
      --json /work/ab/abba_exchange_${i}_${side}.json > /work/ab/abba_exchange_${i}_${side}.log 2>&1
done
i=0
for side in base abmain abmain base; do
  i=$((i+1))
  cd /work/$side
  .venv/bin/hpcsgd bench train --ranks 1,2 --minibatch 1024 --exchange allreduce,onebit \
      --json /work/ab/abba_train_${i}_${side}.json > /work/ab/abba_train_${i}_${side}.log 2>&1
done
echo ABBA-DONE
