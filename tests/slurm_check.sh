#!/usr/bin/env bash
# Slurm for real (scripts/slurm_cluster.sh): a 2-node cluster on this
# machine runs the README's three ways of starting lockstep-train under Slurm.
#  1. srun --mpi=pmix: srun starts the ranks, over the mpi backend.
#  2. sbatch: the README's batch script, its output file checked.
#  3. srun --ntasks-per-node=1 lockstep-run: one launcher per node, which
#     takes --nnodes, --node-rank and the master's address from Slurm.
# All three must train the same job to the same parameters (bit for bit),
# and every sample once per epoch.
#
#   tests/slurm_check.sh SLURM_CLUSTER LOCKSTEP_RUN LOCKSTEP_TRAIN
set -uo pipefail
cluster=$1 run=$2 train=$3
"$cluster" check || exit 77
fail() { echo "FAILED: $*"; exit 1; }

out=$(mktemp -d /var/tmp/lockstep-slurm-check.XXXXXX)
trap 'rm -rf "$out"' EXIT
chmod 755 "$out"
RUN=$run TRAIN=$train OUT=$out "$cluster" run 2 -- bash -c '
  set -u
  job=(--synthetic --train-samples 1024 --test-samples 256 --batch-size 64 --epochs 2)
  export OMP_NUM_THREADS=1
  srun --mpi=pmix --nodes 2 --ntasks-per-node 1 "$TRAIN" "${job[@]}" --out "$OUT/pmix" > "$OUT/pmix.log" 2>&1
  echo "srun --mpi=pmix: exit $?" >> "$OUT/status"

  cat > "$OUT/train.sbatch" <<EOF
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --cpus-per-task=1 --output=$OUT/sbatch-%j.out
export OMP_NUM_THREADS=\$SLURM_CPUS_PER_TASK
srun --mpi=pmix $TRAIN ${job[*]} --out $OUT/sbatch-\$SLURM_JOB_ID
EOF
  sbatch --wait "$OUT/train.sbatch" > "$OUT/sbatch.log" 2>&1
  echo "sbatch: exit $?" >> "$OUT/status"

  srun --nodes 2 --ntasks-per-node 1 "$RUN" --nproc-per-node 1 "$TRAIN" "${job[@]}" --out "$OUT/run" \
    > "$OUT/run.log" 2>&1
  echo "srun lockstep-run: exit $?" >> "$OUT/status"
' > "$out/cluster.log" 2>&1
status=$?
for f in cluster status pmix sbatch run; do echo "==== $f"; grep -v "ETA" "$out/$f.log" 2>/dev/null | tail -12; done
cat "$out"/sbatch-*.out 2>/dev/null | grep -v ETA | tail -12
[ $status -eq 0 ] || fail "the cluster did not run its commands (status $status): $(cat "$out/cluster.log")"
for step in "srun --mpi=pmix" "sbatch" "srun lockstep-run"; do
  grep -q "^$step: exit 0$" "$out/status" || fail "$step failed: $(cat "$out/status")"
done
hash() { sed -n 's/.*final parameters fnv1a64=\([0-9a-f]*\).*/\1/p' "$@" | head -1; }
pmix=$(hash "$out/pmix.log") batch=$(hash "$out"/sbatch-*.out) launched=$(hash "$out/run.log")
grep -q "DistributedDataParallel over 2 ranks (mpi)" "$out/pmix.log" || fail "srun --mpi=pmix did not train over mpi"
grep -q "DistributedDataParallel over 2 ranks (gloo)" "$out/run.log" || fail "lockstep-run under srun did not make 2 ranks"
[ -n "$pmix" ] && [ "$pmix" = "$batch" ] && [ "$pmix" = "$launched" ] ||
  fail "the three ways ended with other parameters: pmix $pmix, sbatch $batch, lockstep-run $launched"
for f in "$out/pmix.log" "$out"/sbatch-*.out "$out/run.log"; do
  grep -q "sample counts: each of the 1024 training samples trained 2 time(s)" "$f" || fail "$f: samples lost or repeated"
done
echo "slurm: srun --mpi=pmix, sbatch and srun lockstep-run trained the same parameters ($pmix) on 2 nodes"
