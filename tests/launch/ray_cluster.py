"""Runs a command against a two-node Ray cluster started for it, then stops the cluster.

  unshare -rn sh -c 'ip link set lo up && exec python tests/launch/ray_cluster.py -- CMD...'

Inside a new network namespace whose only interface is the loopback, nothing the cluster, the
Reverb server or the roles listen on can be reached from outside, whatever address they bind.
The head node has CPUs only; the second node also declares one GPU (simulated: Ray only
counts it), so a learner asking for GPU=1 must land there. `{address}` in CMD becomes the
cluster's address. The first lines printed say where things are:

  interfaces: lo
  cluster: ADDRESS head NODE_ID gpu NODE_ID

SIGTERM and SIGINT are passed on to the command; the exit code is the command's.
"""

import signal
import socket
import subprocess
import sys

from ray.cluster_utils import Cluster


def main(argv: list[str]) -> int:
  command = argv[argv.index("--") + 1:]
  interfaces = sorted(name for _, name in socket.if_nameindex())   # this namespace's
  print(f"interfaces: {' '.join(interfaces)}", flush=True)
  cluster = Cluster(initialize_head=True,
                    head_node_args={"num_cpus": 4, "include_dashboard": False})
  gpu = cluster.add_node(num_cpus=2, num_gpus=1)
  try:
    print(f"cluster: {cluster.address} head {cluster.head_node.node_id} gpu {gpu.node_id}",
          flush=True)
    child = subprocess.Popen([c.replace("{address}", cluster.address) for c in command])
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, lambda s, _: child.send_signal(s))
    return child.wait()
  finally:
    cluster.shutdown()


if __name__ == "__main__":
  sys.exit(main(sys.argv))
