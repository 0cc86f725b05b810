"""A worker node of ftkit's Ray cluster on this host, bound to 127.0.0.1: run by
``ftkit.vllm.ray_cluster`` as ``python -m ftkit.vllm.ray_node SPEC_JSON``.

Ray's own command for a worker node (``ray start --address``) replaces a loopback node address
with the host's reachable one, and its GCS, raylets and agents then listen on the host's
interfaces. With ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (Ray's switch for hosts where it
keeps clusters local) Ray keeps 127.0.0.1, but its command then refuses worker nodes. This
module starts the node the way that command does (``ray._private.node.Node``, as
``ray.cluster_utils`` also does) with that switch set, and then does what ``ray start
--block`` does: it owns the node's processes (their reaper kills them if this process dies),
ends them all when one of them ends (a node whose raylet is gone is lost, and
``RayCluster.dead_nodes`` sees this process end) and on SIGTERM.

SPEC: ``address`` (the head's GCS, ``127.0.0.1:PORT``), ``resources`` (custom Ray resources),
``object_store_bytes``, ``agent_port`` (the dashboard agent's port, free on this host). It
prints ``READY_LINE`` once the node runs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

#: Ray's switch that keeps a node's address, and every listener of it, on 127.0.0.1.
LOCAL_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
#: What this module prints once its node runs.
READY_LINE = "ftkit: Ray worker node started"
LOCALHOST = "127.0.0.1"
#: How often the node's processes are looked at (``ray start --block``: every second).
POLL_S = 0.5


def main() -> None:
    spec = json.loads(sys.argv[1])
    if any(os.environ.get(k) != v for k, v in LOCAL_ONLY_ENV.items()):
        sys.exit(f"ftkit.vllm.ray_node: run with {LOCAL_ONLY_ENV} in the environment "
                 "(ftkit.vllm.ray_cluster does)")
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(node_ip_address=LOCALHOST, gcs_address=spec["address"], num_cpus=0,
                       num_gpus=0, resources=spec["resources"],
                       object_store_memory=spec["object_store_bytes"],
                       dashboard_agent_listen_port=spec["agent_port"],
                       min_worker_port=0, max_worker_port=0)
    # shutdown_at_exit: SIGTERM and exit end the node's processes; spawn_reaper: so does
    # this process's death by SIGKILL (the processes share its fate).
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    print(READY_LINE, flush=True)
    while True:
        time.sleep(POLL_S)
        gone = node.dead_processes()
        if gone:
            names = ", ".join(f"{kind} (exit {proc.returncode})" for kind, proc in gone)
            print(f"ftkit: Ray node process(es) ended: {names}; ending the node", flush=True)
            node.kill_all_processes(check_alive=False, allow_graceful=False)
            # The reaper and the exit handlers need not run: everything is ended.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os._exit(1)


if __name__ == "__main__":
    main()
