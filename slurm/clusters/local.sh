# shellcheck shell=bash
# A CPU-only test cluster on one machine (slurm/local_cluster.sh, used by the tests): its "GPUs"
# are fake, so training runs on the CPU with gloo; one thread per task keeps the cores shared.
COURSE_NEEDS_ACCOUNT=0
export OMP_NUM_THREADS=1
