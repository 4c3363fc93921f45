#!/usr/bin/env bash
# A/B of two trees on one GPU, in one call: end-to-end steps and attention, alternating.
# Usage: tools/ab_h200.sh BEFORE_DIR AFTER_DIR ROUNDS  (DEFT_WORKLOADS: the recorded workloads;
# the tables and logs end up in one archive, $OUT/ab.tar.gz)
set -u
before=$1 after=$2 rounds=${3:-1}
E2E=(--workload 'few-shot b=20' --workload 'beam k=16' --workload 'Medusa APPS-256 verify'
     --workload 'greedy, 1 sequence')
ATT=(--workload 'few-shot b=20' --workload 'speculative t=64' --workload 'reasoning sorting128ToT'
     --workload 'reasoning keywordToT')
declare -A dirs=([before]=$before [after]=$after)
for v in before after; do
  (cd "${dirs[$v]}" && python3 setup.py build_ext --inplace -q > "$OUT/build_$v.log" 2>&1) \
    || echo "build failed in ${dirs[$v]}"
done
for r in $(seq 1 "$rounds"); do
  for v in before after; do
    dir=${dirs[$v]} tag=${v}_$r
    (cd "$dir" && PYTHONUNBUFFERED=1 timeout ${E2E_S:-220} python3 -m deft.cli bench e2e --device cuda \
        --no-transformers "${E2E[@]}" --json "$OUT/e2e_$tag.json" > "$OUT/e2e_$tag.md" 2>&1) \
      || echo "e2e $tag failed: $(tail -3 "$OUT/e2e_$tag.md")"
    (cd "$dir" && PYTHONUNBUFFERED=1 timeout ${ATT_S:-70} python3 -m deft.cli bench attention --device cuda \
        --no-flex "${ATT[@]}" --json "$OUT/att_$tag.json" > "$OUT/att_$tag.md" 2>&1) \
      || echo "attention $tag failed: $(tail -3 "$OUT/att_$tag.md")"
  done
done
for f in "$OUT"/e2e_*.md "$OUT"/att_*.md; do echo "== $f"; grep '^|' "$f" | cut -c1-150; done
(cd "$OUT" && tar czf ab.tar.gz --remove-files e2e_* att_* build_*)
