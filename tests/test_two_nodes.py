"""Two "nodes" on one machine: network namespaces joined by shaped virtual links, one per local rank
(a NIC per GPU), the ranks of one namespace talking over its loopback. The flat ring and the
hierarchical all-reduce timed there differ as ``plan.network_model`` predicts.

What this cannot show: a real NIC's and NVLink's own behaviour (here both are the kernel's TCP
stack on two shared cores, the "NICs" a token-bucket filter), GPUs computing meanwhile, or NCCL's
pipelined trees. Building the namespaces needs root (CAP_NET_ADMIN), ``ip`` and ``tc``; elsewhere
the test says which is missing and skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from course_lib.distributed.launch import free_port
from course_lib.plan import network_model
from course_lib.plan.specs import Link

from conftest import REPO, clean_env

pytestmark = pytest.mark.slow  # two network namespaces joined by shaped links, and runs across them

GPUS_PER_NODE, NODES = 2, 2
RATE_MBIT = 200  # each "NIC": 25 MB/s, far below what two processes of one namespace reach over loopback
MESSAGE_MB = 8


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found (Debian: apt-get install iproute2)" if missing else None


@pytest.fixture(scope="module")
def two_nodes():
    """Namespaces n0 and n1; for each local rank g a veth pair 10.<x>.g.1 (node 0) - 10.<x>.g.2 (node 1),
    each end shaped to RATE_MBIT. Yields (the namespaces, the address of local rank g on node n)."""
    why = _why_not()
    if why:
        pytest.skip(f"two nodes on one machine: {why}")
    tag, subnet = f"{os.getpid() % 100000}", 10 + os.getpid() % 200
    spaces = [f"course{tag}n{node}" for node in range(NODES)]
    try:
        for space in spaces:
            _run("ip", "netns", "add", space)
            _run("ip", "netns", "exec", space, "ip", "link", "set", "lo", "up")
            _run("ip", "netns", "exec", space, "sysctl", "-w", "net.ipv4.conf.all.rp_filter=0")
        for g in range(GPUS_PER_NODE):
            ends = [f"c{tag}g{g}n{node}" for node in range(NODES)]  # what interface(node, g) names
            _run("ip", "link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
            for node, (space, end) in enumerate(zip(spaces, ends, strict=True)):
                inside = ("ip", "netns", "exec", space)
                _run("ip", "link", "set", end, "netns", space)
                _run(*inside, "ip", "addr", "add", f"10.{subnet}.{g}.{node + 1}/24", "dev", end)
                _run(*inside, "ip", "link", "set", end, "up")
                _run(*inside, "tc", "qdisc", "add", "dev", end, "root", "tbf", "rate", f"{RATE_MBIT}mbit",
                     "burst", "64kb", "latency", "200ms")  # fmt: skip
    except (subprocess.CalledProcessError, OSError) as error:
        for space in spaces:
            subprocess.run(["ip", "netns", "del", space], capture_output=True)
        detail = error.stderr.strip() if isinstance(error, subprocess.CalledProcessError) else str(error)
        pytest.skip(f"two nodes on one machine: this machine refused a namespace or a shaped link ({detail})")

    def address(node: int, g: int) -> str:
        return f"10.{subnet}.{g}.{node + 1}"

    def interface(node: int, g: int) -> str:  # the "NIC" local rank g of this node sends through
        return f"c{tag}g{g}n{node}"

    yield spaces, address, interface
    for space in spaces:
        subprocess.run(["ip", "netns", "del", space], capture_output=True)


def _rank(space: str, env: dict) -> subprocess.Popen:
    """One rank of ``bench hierarchy``, started inside the namespace ``space``."""
    options = ["--gpus-per-node", str(GPUS_PER_NODE), "--mb", str(MESSAGE_MB), "--repeats", "2"]
    command = [
        "ip",
        "netns",
        "exec",
        space,
        sys.executable,
        "-m",
        "course_lib.tools.bench",
        "hierarchy",
        *options,
    ]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.timing
def test_the_hierarchy_beats_the_flat_ring_between_two_nodes_as_the_model_predicts(two_nodes):
    spaces, address, interface = two_nodes
    port, world = str(free_port()), NODES * GPUS_PER_NODE
    processes = []
    for node, space in enumerate(spaces):
        for g in range(GPUS_PER_NODE):
            env = clean_env(
                RANK=str(node * GPUS_PER_NODE + g), WORLD_SIZE=str(world), LOCAL_RANK=str(g),
                LOCAL_WORLD_SIZE=str(GPUS_PER_NODE), MASTER_ADDR=address(0, 0), MASTER_PORT=port,
                OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=interface(node, g),
            )  # fmt: skip
            processes.append(_rank(space, env))
    outputs = [process.communicate(timeout=300) for process in processes]
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-3000:]
    result = json.loads(outputs[0][0])
    seconds, size = result["seconds"], result["message_bytes"]
    across = Link(0.0, RATE_MBIT * 1e6 / 8)
    # the node's own link, from the all-reduce inside each node this run timed
    inside = Link(0.0, network_model.ring_bytes("all_reduce", size, GPUS_PER_NODE) / seconds["inside_node"])
    predicted = {
        "flat_ring": network_model.flat_ring_seconds(size, world=world, across=across),
        "hierarchical": network_model.hierarchical_seconds(
            size, gpus_per_node=GPUS_PER_NODE, nodes=NODES, inside=inside, across=across
        ),
    }
    print(json.dumps({"measured": seconds, "predicted": predicted}, indent=1))
    measured_ratio = seconds["flat_ring"] / seconds["hierarchical"]
    predicted_ratio = predicted["flat_ring"] / predicted["hierarchical"]
    assert measured_ratio == pytest.approx(predicted_ratio, rel=0.35), (seconds, predicted)
    # no faster than the shaped links allow; slower by what TCP, gloo and two shared cores add
    for name, expected in predicted.items():
        assert 0.95 * expected <= seconds[name] <= 1.8 * expected, (name, seconds, predicted)
