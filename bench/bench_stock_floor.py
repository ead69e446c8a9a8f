#!/usr/bin/env python3
"""The floor of the fixed stack (issue 36): what daphne, Twisted's TLS and the websockets client cost
per connection and per flow report with no Palisade code at all, on this machine.

    .venv/bin/python bench/bench_stock_floor.py [--connections 3000] [--clients 2] [--concurrency 200] [--idle 20]
        [--reports 2000] [--post-clients 4] [--keep-alive 4] [--flow-threads 16]
        [--only tls,ws,...]

Each measure starts its own daphne (daphne's `Server` in a process of its own, as serve runs it, on a
P-256 certificate made in a temporary directory, with the endpoint string serve gives:
controlplane/listeners.py) and counts its utime + stime (/proc) from when the clients start until
the last has finished, and each client process's own CPU meanwhile.

Streams: --clients processes open --connections connections in all, at most --concurrency at a time
each (a failover storm: every agent wants in at once), and hold them: what they cost held is measured
for --idle seconds after the last is in. Each connects as the agent does
(agent/daemon.py `_open`: a non-blocking socket with the kernel's silence bound, the pinned context of
agent/tls.py, websockets' `connect` with the simulator's settings and buffers: agent/simulated.py).
  tls          a bare TLS handshake on daphne's listener, no HTTP
  ws           the websocket upgrade to a plain ASGI app that accepts and sends one small JSON message
  ws-channels  the same from a stock Channels AsyncWebsocketConsumer (serve's stream is one)
  ws-auth      ws, then the protocol's least authentication (docs/protocol.md): a hello with a nonce, the
               agent's auth with its Ed25519 proof (signed per stream), verified; a welcome (no database)
Reports: --post-clients processes, --keep-alive connections each, POST --reports signed 50-key flow
reports (bench_flows.py's bodies and headers) as bench_flows.py posts them.
  post-asgi    daphne's ASGI app reads the body and answers a fixed JSON
  post-plain   Twisted's request handed to a thread and answered from there (controlplane/plain_reports.py)
  post-verify  the same, the thread parsing the body (json_loads_strict) and verifying its Ed25519 signature
               (and that work alone, in a loop on one thread: work-alone)
Writes bench/results/stock_floor.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import multiprocessing
import os
import random
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from benchlib import cpu_seconds, exit_on_sigterm, results_write  # noqa: E402

STREAMS = ("tls", "ws", "ws-channels", "ws-auth")
POSTS = ("post-asgi", "post-plain", "post-verify")
HELLO = b'{"type":"hello","version":1}'
AUTH_PATH = "/agent/v1/stream/auth"
ANSWER = b'{"accepted":true}'
AGENTS = 200  # signing keys the reports are spread over
LISTEN_BACKLOG = 1024  # serve's (controlplane/listeners.py)
FLOW_THREADS = 16  # serve's flow-report pool


def agent_key(i: int):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"floor-%d" % i).digest())


def agent_id(i: int) -> str:
    return f"00000000-0000-4000-8000-{i:012d}"


# The server: `bench_stock_floor.py --serve KIND PORT CERT KEY THREADS`, in its own process -----------


SERVER: dict = {}  # the server process's fingerprint and agents' public keys, for ws-auth


async def plain_app(scope, receive, send):
    """Accepts a websocket and sends HELLO (or, on AUTH_PATH, the protocol's least authentication: a
    hello with a nonce, the agent's auth with a proof of its key verified, a welcome); answers any HTTP
    request with ANSWER once its body is in."""
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        if scope["path"] != AUTH_PATH:
            await send({"type": "websocket.send", "text": HELLO.decode()})
        else:
            from agent import protocol

            nonce = os.urandom(32)
            hello = {"v": 1, "type": "hello", "nonce": base64.b64encode(nonce).decode(), "server_time": time.time(), "protocol": 1}  # fmt: skip
            await send({"type": "websocket.send", "text": json.dumps(hello)})
            auth = json.loads((await receive())["text"])
            workload = auth["workload_id"]
            verified = protocol.verify_proof(
                SERVER["keys"][workload], auth["proof"], nonce=nonce, workload_id=workload,
                gateway_fingerprint=SERVER["fingerprint"],
            )  # fmt: skip
            welcome = {"v": 1, "type": "welcome", "workload_id": workload, "credential_state": "valid", "expires_at": "2026-12-29T00:00:00Z",
                       "renewal_due_at": "2026-12-19T00:00:00Z", "renew_only": False}  # fmt: skip
            await send(
                {"type": "websocket.send", "text": json.dumps(welcome)}
                if verified
                else {"type": "websocket.close", "code": 4401}
            )
        while (await receive())["type"] != "websocket.disconnect":
            pass
    elif scope["type"] == "http":
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": ANSWER})


def channels_app():
    """A stock Channels consumer: no channel layer, no database (Django configured with neither)."""
    import django
    from django.conf import settings

    settings.configure(SECRET_KEY="bench-only", INSTALLED_APPS=["channels"])  # noqa: S106 - loopback
    django.setup()
    from channels.generic.websocket import AsyncWebsocketConsumer

    class Hello(AsyncWebsocketConsumer):
        async def connect(self):
            await self.accept()
            await self.send(text_data=HELLO.decode())

    return Hello.as_asgi()


def public_keys() -> dict[str, str]:
    return {
        agent_id(i): base64.b64encode(agent_key(i).public_key().public_bytes_raw()).decode()
        for i in range(AGENTS)
    }


def report_checked(
    body: bytes, workload: str, signature: str, keys: dict[str, str], fingerprint: str
) -> None:
    """The fixed work of any flow report's answer: its body parsed as serve parses it, its signature verified."""
    from agent import protocol
    from controlplane.strict_json import json_loads_strict

    json_loads_strict(body)
    verified = protocol.verify_flow_report(
        keys[workload], signature, body=body, workload_id=workload, gateway_fingerprint=fingerprint
    )
    assert verified, "a report's signature did not verify"


def serve(kind: str, port: int, cert: str, key: str, threads: int) -> None:
    import daphne.server  # installs Twisted's asyncio reactor: first  # isort: skip
    from concurrent.futures import ThreadPoolExecutor

    import daphne.http_protocol
    from twisted.internet import reactor

    from agent import protocol
    from controlplane.tls import fingerprint_of

    fingerprint, keys = fingerprint_of(Path(cert).read_bytes()), public_keys()
    SERVER.update(fingerprint=fingerprint, keys=keys)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="flows")

    def answer(body: bytes, workload: str, signature: str) -> bytes:
        if kind == "post-verify":
            report_checked(body, workload, signature, keys, fingerprint)
        return ANSWER

    class PlainRequest(daphne.http_protocol.WebRequest):
        """As controlplane/plain_reports.py: the POST leaves Twisted for a thread, its answer comes back."""

        def process(self):
            if self.method != b"POST":
                return super().process()
            self.request_start = time.time()
            self.client_addr = [str(self.client.host), self.client.port]
            self.server_addr = [str(self.host.host), self.host.port]
            self.content.seek(0, 0)
            body = self.content.read()
            workload = self.requestHeaders.getRawHeaders(protocol.HEADER_WORKLOAD.encode())[0].decode()
            signature = self.requestHeaders.getRawHeaders(protocol.HEADER_SIGNATURE.encode())[0].decode()
            future = pool.submit(answer, body, workload, signature)
            future.add_done_callback(lambda done: reactor.callFromThread(self.answered, done))

        def answered(self, future) -> None:
            content = future.result()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(content)).encode()),
            ]
            self.handle_reply({"type": "http.response.start", "status": 200, "headers": headers})
            self.handle_reply({"type": "http.response.body", "body": content})

    if kind in ("post-plain", "post-verify"):
        daphne.http_protocol.WebRequest = PlainRequest  # what HTTPFactory.buildProtocol hands each channel
    endpoint = f"ssl:port={port}:backlog={LISTEN_BACKLOG}:interface=127.0.0.1:privateKey={key}:certKey={cert}"
    application = channels_app() if kind == "ws-channels" else plain_app
    daphne.server.Server(application, endpoints=[endpoint], signal_handlers=True, verbosity=0).run()


def server_start(kind: str, workdir: Path, threads: int) -> tuple[subprocess.Popen, int, str]:
    from controlplane.tls import ensure_certificate
    from tests.support.serve_process import free_port

    cert = ensure_certificate(workdir, "floor", [])  # EC P-256, self-signed, as serve makes its own
    port = free_port()
    args = [sys.executable, __file__, "--serve", kind, str(port), str(cert.cert_path), str(cert.key_path), str(threads)]  # fmt: skip
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=2)):
                return process, port, cert.cert_path.read_text()
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit(f"the {kind} server did not start")


# The clients --------------------------------------------------------------------------------------------


def stream_client(kind, port, cert_pem, count, concurrency, go, idle, hold, results) -> None:
    """`count` connections as the agent opens them, at most `concurrency` under way; held until `hold`,
    and the CPU they cost held from `idle` to `hold` reported too."""
    from websockets.asyncio.client import connect

    from agent import protocol
    from agent.gateways import silence_bounded
    from agent.simulated import _raise_open_file_limit, _shrink_tls_read_buffers
    from agent.tls import pinned_context
    from controlplane.tls import fingerprint_of

    _raise_open_file_limit()
    _shrink_tls_read_buffers()
    context = pinned_context(cert_pem)
    uri = f"wss://127.0.0.1:{port}" + (AUTH_PATH if kind == "ws-auth" else "/agent/v1/stream")
    fingerprint, keys = fingerprint_of(cert_pem.encode()), [agent_key(i) for i in range(AGENTS)]
    credential = base64.b64encode(random.Random(1).randbytes(300)).decode()  # a real one's length

    async def authenticated(ws, i: int) -> None:
        """The agent's side of the protocol's authentication (docs/protocol.md, the sync stream, 1-3)."""
        hello, workload = json.loads(await ws.recv()), agent_id(i % AGENTS)
        nonce = base64.b64decode(hello["nonce"])
        proof = protocol.sign_proof(
            keys[i % AGENTS], nonce=nonce, workload_id=workload, gateway_fingerprint=fingerprint
        )
        auth = {"v": 1, "type": "auth", "workload_id": workload, "credential": credential, "proof": proof, "agent_version": "0.1.0",
                "process_start_id": "floor", "uptime_seconds": 3600.0, "owned_table": "present", "gateway": f"127.0.0.1:{port}"}  # fmt: skip
        await ws.send(json.dumps(auth))
        assert json.loads(await ws.recv())["type"] == "welcome"

    async def one(gate: asyncio.Semaphore, held: list, failures: list, i: int) -> None:
        async with gate:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            silence_bounded(sock)
            try:
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
                if kind == "tls":
                    transport, _ = await asyncio.get_running_loop().create_connection(
                        asyncio.Protocol, sock=sock, ssl=context, server_hostname="127.0.0.1"
                    )
                    held.append(transport)
                    return
                ws = await connect(
                    uri, sock=sock, ssl=context, max_size=protocol.MAX_MESSAGE_BYTES, open_timeout=60,
                    close_timeout=5, compression=None, proxy=None, user_agent_header="palisade-agent/floor",
                )  # fmt: skip
                if kind == "ws-auth":
                    await authenticated(ws, i)
                else:
                    assert (await ws.recv()).encode() == HELLO
                held.append(ws)
            except Exception as error:  # noqa: BLE001 - counted, and the first few shown
                failures.append(f"{type(error).__name__}: {error}")
                sock.close()

    async def main() -> None:
        gate, held, failures = asyncio.Semaphore(concurrency), [], []
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        cpu, began = time.process_time(), time.time()
        await asyncio.gather(*(one(gate, held, failures, i) for i in range(count)))
        results.put((len(held), failures[:3], len(failures), time.process_time() - cpu, began, time.time()))
        await asyncio.get_running_loop().run_in_executor(None, idle.wait)
        cpu = time.process_time()
        await asyncio.get_running_loop().run_in_executor(None, hold.wait)
        results.put(time.process_time() - cpu)
        for each in held:
            (each if kind == "tls" else each.transport).abort()

    asyncio.run(main())


def post_client(port, cert_pem, requests, connections, go, results) -> None:
    """bench_flows.py's `_post_reports`: keep-alive HTTPS connections, one thread and report in flight each."""
    import http.client
    import threading

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(cadata=cert_pem)
    failures: list[str] = []

    def run(share) -> None:
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=60)
        for body, headers in share:
            conn.request("POST", "/agent/v1/flows", body=body, headers=headers)
            response = conn.getresponse()
            if response.read() != ANSWER or response.status != 200:
                failures.append(f"HTTP {response.status}")
        conn.close()

    threads = [threading.Thread(target=run, args=(requests[i::connections],)) for i in range(connections)]
    go.wait()
    cpu, began = time.process_time(), time.time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done = len(requests) - len(failures)
    results.put((done, failures[:3], len(failures), time.process_time() - cpu, began, time.time()))


def reports_signed(count: int, fingerprint: str) -> list[tuple[bytes, dict]]:
    """bench_flows.py's 50-key bodies, signed as the agent signs them."""
    from bench_flows import report_json

    from agent.flowreport import report_headers

    rng, now = random.Random(20261129), time.time()
    credential = base64.b64encode(rng.randbytes(300)).decode()  # about a real credential's length; unchecked
    requests = []
    for i in range(count):
        body = report_json(rng, now // 60 * 60 - 60 * (1 + i % 30), 50, now)
        headers = report_headers(body, key=agent_key(i % AGENTS), workload_id=agent_id(i % AGENTS),
                                 credential=credential, gateway_fingerprint=fingerprint)  # fmt: skip
        requests.append((body, headers))
    return requests


def work_alone(count: int) -> dict:
    """The parse and the verification of post-verify in a loop on one thread: the work without a server."""
    from agent import protocol

    fingerprint, keys = "AB:CD", public_keys()
    requests = reports_signed(count, fingerprint)
    load, cpu = os.getloadavg(), time.process_time()
    for body, headers in requests:
        workload, signature = headers[protocol.HEADER_WORKLOAD], headers[protocol.HEADER_SIGNATURE]
        report_checked(body, workload, signature, keys, fingerprint)
    took = time.process_time() - cpu
    return {"kind": "work-alone", "unit": "report", "done": count, "cpu_ms": round(took / count * 1e3, 3),
            "load_start": [round(x, 2) for x in load], "load_end": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip


def measure(kind: str, args, workdir: Path) -> dict:
    from controlplane.tls import fingerprint_of

    ctx = multiprocessing.get_context("spawn")
    go, idle, hold, results = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    process, port, cert_pem = server_start(kind, workdir / kind, args.flow_threads)
    workers = []
    try:
        if kind in STREAMS:
            total, unit = args.connections, "connection"
            shares = [total // args.clients + (i < total % args.clients) for i in range(args.clients)]
            workers = [ctx.Process(target=stream_client, args=(kind, port, cert_pem, n, args.concurrency, go, idle, hold, results))
                       for n in shares]  # fmt: skip
        else:
            total, unit = args.reports, "report"
            requests = reports_signed(total, fingerprint_of(cert_pem.encode()))
            workers = [ctx.Process(target=post_client, args=(port, cert_pem, requests[c :: args.post_clients], args.keep_alive, go, results))
                       for c in range(args.post_clients)]  # fmt: skip
        for worker in workers:
            worker.start()
        time.sleep(3)  # the clients' imports and contexts, outside the measure
        load_before, server_before = os.getloadavg(), cpu_seconds(process.pid)
        go.set()
        answers = [results.get(timeout=600) for _ in workers]
        server_cpu, load_after = cpu_seconds(process.pid) - server_before, os.getloadavg()
        held = {}
        if (
            kind in STREAMS
        ):  # what the held connections cost, idle: keepalive pings both ways, daphne's checks
            idle.set()
            before = cpu_seconds(process.pid)
            time.sleep(args.idle)
            held["server"] = cpu_seconds(process.pid) - before
        hold.set()
        if kind in STREAMS:
            held["clients"] = sum(results.get(timeout=60) for _ in workers)
        for worker in workers:
            worker.join(60)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    done = sum(a[0] for a in answers)
    failed = sum(a[2] for a in answers)
    wall = max(a[5] for a in answers) - min(a[4] for a in answers)
    result = {
        "kind": kind,
        "unit": unit,
        "done": done,
        "failures": failed,
        "failure_examples": [f for a in answers for f in a[1]][:3],
        "server_cpu_ms": round(server_cpu / max(done, 1) * 1e3, 3),
        "client_cpu_ms": round(sum(a[3] for a in answers) / max(done, 1) * 1e3, 3),
        "per_second": round(done / wall, 1),
        "wall_seconds": round(wall, 2),
        "load_start": [round(x, 2) for x in load_before],
        "load_end": [round(x, 2) for x in load_after],
    }
    result["both_cpu_ms"] = round(result["server_cpu_ms"] + result["client_cpu_ms"], 3)
    for side, cpu in held.items():  # us of CPU a held connection costs a second
        result[f"held_{side}_cpu_us_per_second"] = round(cpu / args.idle / max(done, 1) * 1e6, 2)
    return result


def main() -> int:
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]))
        return 0
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=2, help="stream client processes (the simulators: 2)")
    parser.add_argument(
        "--concurrency", type=int, default=200, help="connections under way per client process"
    )
    parser.add_argument("--idle", type=float, default=20.0, help="seconds the held streams are measured idle")
    parser.add_argument("--reports", type=int, default=2000)
    parser.add_argument("--post-clients", type=int, default=4, help="as bench_flows.py's --clients")
    parser.add_argument("--keep-alive", type=int, default=4, help="as bench_flows.py's --connections")
    parser.add_argument(
        "--flow-threads", type=int, default=FLOW_THREADS, help="the post servers' thread pool"
    )
    parser.add_argument("--only", default=",".join(STREAMS + POSTS), help="the measures, comma-separated")
    args = parser.parse_args()
    kinds = [k for k in args.only.split(",") if k]
    unknown = set(kinds) - set(STREAMS + POSTS)
    if unknown:
        parser.error(f"unknown measures {sorted(unknown)}")
    measures = {}
    with tempfile.TemporaryDirectory(prefix="palisade-floor-") as tmp:
        for kind in kinds:
            (Path(tmp) / kind).mkdir()
            m = measures[kind] = measure(kind, args, Path(tmp))
            print(f"{kind:12} server {m['server_cpu_ms']:6.3f} ms CPU a {m['unit']}, clients {m['client_cpu_ms']:6.3f} ms "
                  f"(both {m['both_cpu_ms']:6.3f}), {m['per_second']:7.1f}/s, {m['done']} done, {m['failures']} failed "
                  f"{m['failure_examples'][:1]}; load {m['load_start'][0]:.2f} -> {m['load_end'][0]:.2f}", flush=True)  # fmt: skip
            if "held_server_cpu_us_per_second" in m:
                print(f"{'':12} held idle: server {m['held_server_cpu_us_per_second']:.2f} us CPU a connection a second, "
                      f"clients {m['held_clients_cpu_us_per_second']:.2f} us")  # fmt: skip
    if "post-verify" in kinds:
        m = measures["work-alone"] = work_alone(args.reports)
        print(
            f"work-alone   {m['cpu_ms']:6.3f} ms CPU a report: post-verify's parse and verification in a loop"
        )
    results_write(
        "stock_floor",
        {
            "args": vars(args),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "cpus": os.cpu_count(),
            "measures": measures,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
