#!/usr/bin/env python3
"""Authenticated GET /api/v1/me over TLS against the real `serve`, compared with a stock Django deployment
of the same view (Django's ASGI handler on daphne, DRF's stock token authentication, default middleware:
bench/stock_django/) measured in the same run; the target is serve >= 3x stock. A bare daphne endpoint
(no application at all) is measured too, as the ceiling.

Both servers run as separate processes on this host with the same kind of TLS endpoint (daphne `ssl:`,
EC P-256 certificate). The client keeps one HTTP/1.1 connection per concurrent client open for the whole
run, spread over a few processes so that the client's own GIL is not what is measured. Each target gets a
warm-up, then a fixed measuring window; requests/s counts responses completed inside the window.

    .venv/bin/python bench/bench_me.py [--clients 16] [--duration 10] [--warmup 3]

Storage is SQLite in a fresh data directory, or a throwaway PostgreSQL database when DATABASE_URL is set.
Writes bench/results/me.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import platform
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "me.json"
TARGET_RATIO = 3.0  # serve / stock Django
BARE_BODY = json.dumps(
    {
        "operator": "operator",
        "credential": {"kind": "token", "label": "bench"},
        "site_label": "",
        "gateway_address": "localhost:8443",
        "version": "0.1.0",
    }
).encode()


async def bare_app(scope, receive, send):
    """The baseline: what daphne and TLS cost with no application work at all."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(BARE_BODY)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": BARE_BODY})


# The client -------------------------------------------------------------------------------------------


def _client_process(target: dict, connections: int, warm_end: float, end: float, results) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(cadata=target["cert_pem"])  # pinned, as a real client would
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def run() -> None:
        mine, bad = [], []
        conn = http.client.HTTPSConnection(target["host"], target["port"], context=context, timeout=30)
        while (started := time.time()) < end:
            try:
                conn.request("GET", target["path"], headers=target["headers"])
                response = conn.getresponse()
                response.read()
            except (OSError, http.client.HTTPException) as error:
                bad.append(f"{type(error).__name__}: {error}")
                conn.close()
                conn = http.client.HTTPSConnection(
                    target["host"], target["port"], context=context, timeout=30
                )
                continue
            finished = time.time()
            if response.status != 200:
                bad.append(f"HTTP {response.status}")
            elif warm_end <= finished < end:
                mine.append(finished - started)
        conn.close()
        with lock:
            latencies.extend(mine)
            failures.extend(bad)

    threads = [threading.Thread(target=run) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.put((latencies, failures[:20], len(failures)))


def measure(target: dict, *, clients: int, processes: int, warmup: float, duration: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    start = time.time() + 1.0  # spawned interpreters need a moment to start
    warm_end, end = start + warmup, start + warmup + duration
    shares = [clients // processes + (1 if i < clients % processes else 0) for i in range(processes)]
    workers = [
        ctx.Process(target=_client_process, args=(target, share, warm_end, end, results))
        for share in shares
        if share
    ]
    for worker in workers:
        worker.start()
    latencies, failures, failure_count = [], [], 0
    for _ in workers:
        lat, fail, count = results.get(timeout=warmup + duration + 120)
        latencies.extend(lat)
        failures.extend(fail)
        failure_count += count
    for worker in workers:
        worker.join()
    if not latencies:
        raise SystemExit(f"no successful request to {target['name']}: {failures[:5]}")
    latencies.sort()
    return {
        "requests": len(latencies),
        "requests_per_second": round(len(latencies) / duration, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 2),
        "p99_ms": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000, 2),
        "failures": failure_count,
        "failure_examples": failures[:5],
    }


# The servers ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_tls(port: int, process: subprocess.Popen, timeout: float = 30) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the bare daphne endpoint exited with {process.returncode}")
        try:
            with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=2)):
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the bare daphne endpoint did not start")


def _start_daphne(workdir: Path, name: str, application: str, env: dict | None = None):
    from twisted.internet.endpoints import quoteStringArgument

    from controlplane.tls import ensure_certificate

    cert = ensure_certificate(workdir, name, [])
    port = _free_port()
    endpoint = (
        f"ssl:port={port}:interface=127.0.0.1:privateKey={quoteStringArgument(str(cert.key_path))}"
        f":certKey={quoteStringArgument(str(cert.cert_path))}"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-v", "0", "-e", endpoint, application],
        cwd=Path(__file__).parent,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for_tls(port, process)
    return process, port, cert.cert_path.read_text()


def start_stock_django(workdir: Path):
    """The stock deployment in its own scratch directory; returns (process, port, cert, token)."""
    home = workdir / "stock"
    home.mkdir()
    env = {"STOCK_DJANGO_DIR": str(home), "DJANGO_SETTINGS_MODULE": "stock_django.settings"}
    token = subprocess.run(
        [sys.executable, "-m", "stock_django.setup"],
        cwd=Path(__file__).parent,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    process, port, pem = _start_daphne(workdir, "stock", "stock_django.asgi:application", env)
    return process, port, pem, token


def start_bare_daphne(workdir: Path):
    return _start_daphne(workdir, "bare", "bench_me:bare_app")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--processes", type=int, default=4, help="client processes sharing the connections")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from tests.support.serve_process import Site

    load = dict(clients=args.clients, processes=args.processes, warmup=args.warmup, duration=args.duration)
    with tempfile.TemporaryDirectory(prefix="palisade-bench-") as tmp, Site.fresh(Path(tmp) / "data") as site:
        bare, bare_port, bare_pem = start_bare_daphne(Path(tmp))
        stock, stock_port, stock_pem, stock_token = start_stock_django(Path(tmp))
        try:
            serve = site.serve()
            token = serve.mint_operator_token("bench")
            serve_target = {
                "name": "serve",
                "host": "127.0.0.1",
                "port": serve.address("operator")[1],
                "path": "/api/v1/me",
                "headers": {"Authorization": f"Bearer {token}"},
                "cert_pem": (site.data_dir / "operator-cert.pem").read_text(),
            }
            bare_target = {
                "name": "bare daphne",
                "host": "127.0.0.1",
                "port": bare_port,
                "path": "/api/v1/me",
                "headers": {"Authorization": f"Bearer {token}"},
                "cert_pem": bare_pem,
            }
            stock_target = {
                "name": "stock Django",
                "host": "127.0.0.1",
                "port": stock_port,
                "path": "/api/v1/me",
                "headers": {"Authorization": f"Token {stock_token}"},
                "cert_pem": stock_pem,
            }
            bare_result = measure(bare_target, **load)
            stock_result = measure(stock_target, **load)
            serve_result = measure(serve_target, **load)
            assert serve.stop() == 0
        finally:
            for process in (bare, stock):
                process.terminate()
                process.wait(10)
        storage = "postgresql" if site.database_url else "sqlite"

    ratio = serve_result["requests_per_second"] / stock_result["requests_per_second"]
    of_bare = serve_result["requests_per_second"] / bare_result["requests_per_second"]
    report = {
        "benchmark": "authenticated GET /api/v1/me over TLS",
        "command": "bench/run  (or: .venv/bin/python bench/bench_me.py)",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "storage": storage,
        "load": load,
        "serve": serve_result,
        "stock_django": stock_result,
        "bare_daphne": bare_result,
        "ratio": round(ratio, 3),
        "ratio_of_bare": round(of_bare, 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")

    print(
        f"GET /api/v1/me, {args.clients} keep-alive TLS clients, "
        f"{args.duration:g} s after {args.warmup:g} s warm-up"
    )
    for name, result in (
        ("serve (" + storage + ")", serve_result),
        ("stock Django", stock_result),
        ("bare daphne", bare_result),
    ):
        print(
            f"  {name:20} {result['requests_per_second']:8.1f} req/s   p50 {result['p50_ms']:7.2f} ms"
            f"   p99 {result['p99_ms']:7.2f} ms   failures {result['failures']}"
        )
    verdict = "meets" if report["meets_target"] else "MISSES"
    print(f"  ratio serve/stock    {ratio:8.3f}   ({verdict} the target {TARGET_RATIO})")
    print(f"  ratio serve/bare     {of_bare:8.3f}   (the ceiling: daphne and TLS with no application)")
    print(f"  wrote {args.output.relative_to(REPO) if args.output.is_relative_to(REPO) else args.output}")


if __name__ == "__main__":
    main()
