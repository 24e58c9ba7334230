# shellcheck shell=bash
# A CPU-only test cluster on one machine (slurm/local_cluster.sh, used by the tests): its "GPUs"
# are fake, so training runs on the CPU with gloo. Its nodes advertise 64 cores that are really
# the machine's few, so the cores a task is "given" are not there: one thread per process keeps
# the real cores shared instead of oversubscribed.
COURSE_NEEDS_ACCOUNT=0
COURSE_NEEDS_GPUS=1
export OMP_NUM_THREADS=1
