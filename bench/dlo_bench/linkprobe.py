"""The check that the simulated links run at their configured rates.

`measure_mbit` times one HTTP transfer between two namespaces of a `dlo_bench.netns.Cluster`
(a one-request server and a client, both stdlib, both run with `ip netns exec`). Called by
`dlo_bench.cluster` before any loader is timed, and by the tests of the kernel's byte counters.
It must not create or shape links.
"""

from __future__ import annotations

import subprocess
import sys

from dlo_bench.netns import Cluster, NetnsUnavailable


# One GET of `nbytes` zero bytes: the server answers a single request and exits.
_PROBE_SERVER = """
import http.server, sys
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
block = memoryview(bytes(1 << 20))
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        left = size
        while left:
            n = min(left, len(block))
            self.wfile.write(block[:n])
            left -= n
    def log_message(self, *args):
        pass
server = http.server.HTTPServer((host, port), Handler)
print("ready", flush=True)
server.handle_request()
"""

# Reads the whole body and prints the seconds from the request to the last byte.
_PROBE_CLIENT = """
import sys, time, urllib.request
started = time.perf_counter()
with urllib.request.urlopen(sys.argv[1], timeout=60) as response:
    while response.read(1 << 20):
        pass
print(time.perf_counter() - started)
"""


def measure_mbit(cluster: Cluster, *, server_ns: str, server_addr: str, client_ns: str,
                 nbytes: int, port: int = 18080) -> float:
    """Achieved rate (Mbit/s) of one HTTP transfer of `nbytes` from `server_ns` to `client_ns`:
    the check that the shaping holds, run before the loaders are timed."""
    server_argv = cluster.exec_argv(
        server_ns, [sys.executable, "-c", _PROBE_SERVER, server_addr, str(port), str(nbytes)]
    )
    # The with block closes the pipe and reaps the server however the probe ends.
    with subprocess.Popen(server_argv, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise NetnsUnavailable(f"link probe server in {server_ns} did not start")
            done = subprocess.run(
                cluster.exec_argv(client_ns, [sys.executable, "-c", _PROBE_CLIENT,
                                              f"http://{server_addr}:{port}/"]),
                capture_output=True, text=True, timeout=120,
            )
        finally:
            server.kill()
    if done.returncode != 0:
        raise NetnsUnavailable(
            f"link probe from {server_ns} to {client_ns} failed: {done.stderr.strip()}"
        )
    return nbytes * 8 / float(done.stdout.strip()) / 1e6
