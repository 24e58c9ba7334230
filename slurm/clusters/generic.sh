# shellcheck shell=bash
# Any Slurm cluster with NVIDIA GPUs and nothing special about its network: no extra settings.
# Copy this file to slurm/clusters/<yours>.sh to keep your cluster's settings apart from the jobs
# (modules to load, a container or virtual environment to activate, network variables, and
# COURSE_LINK_GBPS, the bandwidth of one node's link, for slurm/network_check.sbatch).
COURSE_NEEDS_ACCOUNT=0
COURSE_NEEDS_GPUS=1
