#!/bin/bash
# Solver variants x solver seeds x models on one GPU call, every bundle solved AND audited on the same dumps.
# Before the call, here: the setup of scripts/gpu16/setup.sh (build/gpu16/site, .whl), and one file per variant,
# build/gpu16/var/NAME.toml, holding [solver.ftpo] key lines without the header (e.g. `lambda_shape = 0.1`);
# the name `def` (no file) is the toolkit's defaults. Then `run` with carry ["build/gpu16", ".whl"] and
#   rm -rf build/gpu16/out; P=8 TO=400 timeout 590 bash scripts/gpu16/var.sh "def NAME" "0 1 2" demo,model2
# Per call: scripts/bench_efficacy.py --methods '' once (dumps + sets per model), then per run --methods ftpo
# --reuse --solver (seed = s + the variant's lines), P runs at a time (their solve seconds are contended).
# Prints build/gpu16/out/summary.tsv (scripts/gpu16/var_summary.py) and leaves results.json / report.json of
# every run in $OUT/runs.tgz.
VARS=$1; SEEDS=$2; MODELS=${3:-demo,model2}; P=${P:-6}; TO=${TO:-400}
source scripts/gpu16/setup.sh
O=build/gpu16/out; mkdir -p $O
t0=$(date +%s)
python3 scripts/bench_efficacy.py --out $O/base --models $MODELS --methods '' --device cuda > $O/base.log 2>&1 \
  || { tail -30 $O/base.log; exit 3; }
echo "dumps+sets $(( $(date +%s)-t0 )) s"
n=0
for v in $VARS; do for s in $SEEDS; do for m in ${MODELS//,/ }; do
  d=$O/$v-s$s-$m; mkdir -p $d/$m; cp $O/base/$m/dumps.json $O/base/$m/sets.json $d/$m/
  { echo "[solver.ftpo]"; echo "seed = $s"; [ -f build/gpu16/var/$v.toml ] && cat build/gpu16/var/$v.toml; } > $d/solver.toml
  ( timeout $TO python3 scripts/bench_efficacy.py --out $d --models $m --methods ftpo --reuse --device cuda \
      --solver $d/solver.toml > $d/log.txt 2>&1; echo "rc $?" >> $d/log.txt ) &
  n=$((n+1)); if [ $n -ge $P ]; then wait -n; n=$((n-1)); fi
done; done; done
wait
echo "all $(( $(date +%s)-t0 )) s"
python3 scripts/gpu16/var_summary.py $O > $O/summary.tsv; cat $O/summary.tsv
mkdir -p $OUT; (cd $O && find . -name results.json -o -name report.json | grep -v '^./base' | tar czf $OUT/runs.tgz -T -)
