#!/bin/bash
# Solver variants x solver seeds x models on one GPU machine, zoo models included (issue 37): every bundle solved
# AND audited on the same dumps. Models: demo, model2 and zoo<S> (scripts/make_zoo.py seed S, built here on the GPU
# into build/zoo unless cached). Variants: build/gpu16/var/NAME.toml holds [solver.ftpo] key lines without the
# header; `def` (no file) is the toolkit's defaults. Same setup as var.sh (scripts/gpu16/setup.sh). Start it
# detached and poll (a call lasts 10 minutes at most):
#   setsid nohup bash scripts/gpu16/zoo_var.sh "def relax0" "0" "demo model2 zoo123 zoo456" > build/gpu16/zv.log 2>&1 &
# Writes $ZV_OUT (default /tmp/zoo_var)/summary.tsv (var_summary.py) and DONE there. Poll with calls that carry
# nothing: a call that carries build/gpu16 replaces that folder on the machine.
VARS=$1; SEEDS=$2; MODELS=${3//,/ }; P=${P:-8}; TO=${TO:-900}
source scripts/gpu16/setup.sh
O=${ZV_OUT:-/tmp/zoo_var}; R=$PWD/build/zoo; mkdir -p $O $R  # outside build/gpu16: a later call that carries build/gpu16 replaces it
t0=$(date +%s)
margs() {  # bench_efficacy's arguments naming one model
  case $1 in zoo*) echo "--zoo-seeds ${1#zoo} --zoo-root $R --models ''" ;; *) echo "--models $1" ;; esac
}
for m in $MODELS; do  # dumps + sets per model, all at once (zoo models are built first, on the GPU)
  ( eval python3 scripts/bench_efficacy.py --out $O/base-$m $(margs $m) --methods "''" --device cuda \
      > $O/base-$m.log 2>&1; echo "rc $?" >> $O/base-$m.log ) &
done
wait
echo "dumps+sets $(( $(date +%s)-t0 )) s"
n=0
for v in $VARS; do for s in $SEEDS; do for m in $MODELS; do
  [ -f $O/base-$m/$m/sets.json ] || { echo "$m: no sets ($(tail -3 $O/base-$m.log | tr '\n' ' '))"; continue; }
  d=$O/$v-s$s-$m; mkdir -p $d/$m; cp $O/base-$m/$m/dumps.json $O/base-$m/$m/sets.json $d/$m/
  { echo "[solver.ftpo]"; echo "seed = $s"; [ -f build/gpu16/var/$v.toml ] && cat build/gpu16/var/$v.toml; } > $d/solver.toml
  ( eval timeout $TO python3 scripts/bench_efficacy.py --out $d $(margs $m) --methods ftpo --reuse --device cuda \
      --solver $d/solver.toml > $d/log.txt 2>&1; echo "rc $?" >> $d/log.txt ) &
  n=$((n+1)); if [ $n -ge $P ]; then wait -n; n=$((n-1)); fi
done; done; done
wait
echo "all $(( $(date +%s)-t0 )) s"
python3 scripts/gpu16/var_summary.py $O > $O/summary.tsv; cat $O/summary.tsv
[ -n "$OUT" ] && mkdir -p $OUT && (cd $O && find . -name results.json -o -name report.json -o -name "*.solve.json" | grep -v '^./base' \
  | tar czf $OUT/runs.tgz -T -)
touch $O/DONE
