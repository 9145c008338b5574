"""The HTTP layer under the Tinker SDK's traffic: today's threaded standard-library server (`gym serve`)
against an asyncio stack (Starlette on uvicorn, as vLLM and SGLang serve), both over the same TinkerAPI, no
model. It only measures, it never passes or fails.

    python bench/http_stacks.py [--polls 100 1000] [--quick 2000]

What it measures, each stack in its own server process, the client in this one:
- held polls: N `retrieve_future` long polls open at once on unfinished futures (the SDK keeps one per
  request in flight; an RL recipe keeps a sample request per group member in flight, up to the SDK's 2,000):
  the server's threads and resident memory while they wait, how long a `healthz` takes beside them, and the
  time from finishing all N futures to the last of the N replies;
- quick requests: sequential submit-sized requests on one keep-alive connection (the SL loop's pattern: a
  forward_backward, an optim_step and their polls per step), requests per second.

The asyncio side is the port an ASGI server would need: retrieve_future waits on the future in the event
loop (no thread per poll) and everything else runs TinkerAPI.handle in a worker thread.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

POLL_SECONDS = 30.0  # what gym serve holds a poll for


# -- the two servers (run with --serve) ---------------------------------------------------------------------
def _api(root: str):
    from hanzo_gym.serve.tinker_api import Reply, TinkerAPI
    from hanzo_gym.tinker.service_client import ServiceClient

    api = TinkerAPI(ServiceClient(root=root), {}, long_poll_seconds=POLL_SECONDS)
    pending: list[concurrent.futures.Future] = []

    def control(command: dict) -> dict:
        """Bench-only operations: make N pending futures, finish them, report threads and memory."""
        if command["op"] == "make":
            made = []
            for _ in range(command["n"]):
                future: concurrent.futures.Future = concurrent.futures.Future()
                pending.append(future)
                with api._lock:
                    made.append(api._register(None, future, lambda value: Reply.json(value))["request_id"])
            return {"request_ids": made}
        if command["op"] == "finish":
            for future in pending:
                future.set_result({"type": "done"})
            pending.clear()
            return {}
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status)
        return {"threads": int(fields["Threads"]), "rss_mb": int(fields["VmRSS"].split()[0]) / 1024}

    return api, control


def serve_threaded(root: str) -> None:
    from hanzo_gym.serve.server import _Handler, _HTTPServer

    api, control = _api(root)

    class Handler(_Handler):
        def _dispatch(self) -> None:
            if self.path == "/bench":
                self._body_read = False
                self._send_json(200, control(json.loads(self._read_body())))
                return
            super()._dispatch()

    httpd = _HTTPServer(("127.0.0.1", 0), Handler)
    httpd.models, httpd.verbose, httpd.tinker = None, False, api
    print(f"listening on http://127.0.0.1:{httpd.server_address[1]}", flush=True)
    httpd.serve_forever()


def serve_asgi(root: str) -> None:
    import anyio
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    api, control = _api(root)

    async def bench(request: Request) -> Response:
        return JSONResponse(control(json.loads(await request.body())))

    async def tinker(request: Request) -> Response:
        body = await request.body()
        if request.url.path.endswith("/retrieve_future"):
            pending = api._futures.get(json.loads(body).get("request_id", ""))
            if pending is not None and not pending.future.done():
                try:  # in the loop: a held poll costs no thread
                    await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending.future)), POLL_SECONDS)
                except TimeoutError:
                    pass
        reply = await anyio.to_thread.run_sync(
            api.handle, request.method, request.url.path, request.headers, body, request.url.query
        )
        return Response(reply.body, reply.status, media_type=reply.content_type)

    app = Starlette(
        routes=[
            Route("/bench", bench, methods=["POST"]),
            Route("/api/v1/{rest:path}", tinker, methods=["GET", "POST"]),
        ]
    )
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_keep_alive=600)
    server = uvicorn.Server(config)

    async def main() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        print(f"listening on http://127.0.0.1:{port}", flush=True)
        await serving

    asyncio.run(main())


# -- the client -------------------------------------------------------------------------------------------
def start(stack: str, root: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", stack, "--root", root], stdout=subprocess.PIPE, text=True
    )
    line = process.stdout.readline()
    match = re.search(r"listening on (\S+)", line)
    if not match:
        process.kill()
        raise SystemExit(f"{stack} server did not start: {line!r}")
    return process, match.group(1)


async def _request(url: str, method: str, path: str, body: dict | None = None) -> dict:
    """One request on its own connection, in plain asyncio streams: a client that costs next to nothing per
    connection (httpx's pool slows down with a thousand of them and would be what gets measured)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()
    status_line = await reader.readline()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    payload = await reader.readexactly(length)
    writer.close()
    if b" 200 " not in status_line:
        raise RuntimeError(f"{path}: {status_line!r} {payload!r}")
    return json.loads(payload)


async def held_polls(url: str, n: int) -> dict:
    request_ids = (await _request(url, "POST", "/bench", {"op": "make", "n": n}))["request_ids"]
    finished_at: list[float] = []

    async def poll(request_id: str) -> None:
        reply = await _request(url, "POST", "/api/v1/retrieve_future", {"request_id": request_id})
        assert reply == {"type": "done"}, reply
        finished_at.append(time.perf_counter())

    polls = [asyncio.create_task(poll(r)) for r in request_ids]
    await asyncio.sleep(2.0 + n / 250)  # every poll reaches the server and waits there
    held = await _request(url, "POST", "/bench", {"op": "stats"})
    started = time.perf_counter()
    for _ in range(20):
        await _request(url, "GET", "/api/v1/healthz")
    healthz_ms = (time.perf_counter() - started) / 20 * 1000
    finish = time.perf_counter()
    await _request(url, "POST", "/bench", {"op": "finish"})
    await asyncio.gather(*polls)
    return {**held, "healthz_ms": healthz_ms, "fan_out_ms": (max(finished_at) - finish) * 1000}


def quick_requests(url: str, count: int) -> float:
    import httpx

    with httpx.Client(base_url=url, timeout=60.0) as client:
        request_ids = client.post("/bench", json={"op": "make", "n": count}).json()["request_ids"]
        client.post("/bench", json={"op": "finish"})
        started = time.perf_counter()
        for request_id in request_ids:
            client.post("/api/v1/retrieve_future", json={"request_id": request_id}).raise_for_status()
        return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--polls", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--quick", type=int, default=2000)
    parser.add_argument("--serve", choices=["threaded", "asgi"], help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.serve:
        (serve_threaded if opts.serve == "threaded" else serve_asgi)(opts.root)
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * max(opts.polls) + 256)), hard))
    rows = []
    for stack in ("threaded", "asgi"):
        with tempfile.TemporaryDirectory() as root:
            process, url = start(stack, root)
            try:
                idle = asyncio.run(held_polls(url, 1))
                row = {
                    "stack": stack,
                    "idle_rss_mb": idle["rss_mb"],
                    "req_per_s": quick_requests(url, opts.quick),
                }
                for n in opts.polls:
                    row[n] = asyncio.run(held_polls(url, n))
                rows.append(row)
            finally:
                process.kill()
                process.wait()
    names = {"threaded": "threaded stdlib (gym serve)", "asgi": "Starlette + uvicorn"}
    print(f"Tinker API HTTP layer, no model; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"  {'stack':30} {'quick req/s':>11} {'idle RSS MB':>11}")
    for row in rows:
        print(f"  {names[row['stack']]:30} {row['req_per_s']:11.0f} {row['idle_rss_mb']:11.1f}")
    for n in opts.polls:
        print(f"  {n} held polls: {'threads':>8} {'RSS MB':>8} {'healthz ms':>11} {'all replies ms':>15}")
        for row in rows:
            r = row[n]
            print(
                f"    {names[row['stack']]:28} {r['threads']:8d} {r['rss_mb']:8.1f} {r['healthz_ms']:11.2f} "
                f"{r['fan_out_ms']:15.1f}"
            )
    threaded, asgi = rows
    print(f"  quick requests, asgi / threaded: {asgi['req_per_s'] / threaded['req_per_s']:.2f}x")


if __name__ == "__main__":
    threading.stack_size(0)
    main()
