# shellcheck shell=bash
# CSCS Alps (GH200 nodes: 4 GPUs, 288 Arm cores, Slingshot 11 network). Every job is charged to a
# project: submit with sbatch --account=<project>.
#
# NCCL reaches the Slingshot network only through the aws-ofi-nccl (libfabric) plugin; the
# variables below are those CSCS documents for NCCL on Alps (docs.cscs.ch, "Communication
# libraries > NCCL"); check that page for changes. Your uenv or container must provide the
# plugin (the CSCS container hook sets the same variables).
COURSE_NEEDS_ACCOUNT=1
export NCCL_NET="AWS Libfabric"      # use the plugin; fail instead of silently falling back to TCP
export NCCL_NET_GDR_LEVEL=PHB        # GPUDirect RDMA when GPU and NIC share a NUMA node
export NCCL_CROSS_NIC=1
export FI_CXI_DEFAULT_CQ_SIZE=131072 # libfabric (CXI provider) settings for the Alps network
export FI_CXI_DEFAULT_TX_SIZE=32768
export FI_CXI_DISABLE_HOST_REGISTER=1
export FI_CXI_RX_MATCH_MODE=software
export FI_MR_CACHE_MONITOR=userfaultfd
export MPICH_GPU_SUPPORT_ENABLED=0
# 72 cores per GPU; leave a few to the data loaders of each task.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}
