"""The floor under the router's per-message cost: a bare grpc.aio server that only streams messages.

    python bench/grpc_stream_floor.py --streams 512 --modes gen,write

One server process streams ``GenerateResponse`` messages of 2 tokens (as ``bench_router.py``'s synthetic
instances send) to ``--streams`` client streams (two client processes, closed loop, 128 messages per call),
one message per stream per 20 ms tick, from an async generator (``gen``, as the router's ``Generate``) or
``context.write`` (``write``). Printed: messages/s and the server's CPU (user + system) per message: what
grpc.aio itself costs per client message on this machine, with nothing of the router's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def server_main(mode: str, conn) -> None:
    import grpc

    from proto.eyrie.v1 import eyrie_pb2 as pb

    async def run() -> None:
        tick = [asyncio.Event()]

        async def ticker() -> None:
            while True:
                await asyncio.sleep(0.02)
                old, tick[0] = tick[0], asyncio.Event()
                old.set()

        def message(i: int) -> pb.GenerateResponse:
            return pb.GenerateResponse(request_id="x", token_ids=[i, i], logprobs=[0.0, 0.0])

        async def gen(raw, context):
            for i in range(128):
                await tick[0].wait()
                yield message(i)

        async def write(raw, context):
            for i in range(128):
                await tick[0].wait()
                await context.write(message(i))

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("eyrie.v1.Generation", {
            "Generate": grpc.unary_stream_rpc_method_handler(
                gen if mode == "gen" else write, response_serializer=pb.GenerateResponse.SerializeToString)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        asyncio.get_running_loop().create_task(ticker())
        conn.send((os.getpid(), port))
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    asyncio.run(run())


def client_main(port: int, streams: int, seconds: float, conn) -> None:
    import grpc

    from proto.eyrie.v1 import eyrie_pb2 as pb
    from proto.eyrie.v1 import eyrie_pb2_grpc as pb_grpc

    async def run() -> int:
        stub = pb_grpc.GenerationStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        got, stop = [0], time.monotonic() + seconds

        async def slot() -> None:
            while time.monotonic() < stop:
                async for _ in stub.Generate(pb.GenerateRequest()):
                    got[0] += 1

        await asyncio.gather(*(slot() for _ in range(streams)))
        return got[0]

    conn.send(asyncio.run(run()))


def measure(mode: str, streams: int, seconds: float, warmup_s: float) -> dict:
    import psutil

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=server_main, args=(mode, child), daemon=True)
    server.start()
    pid, port = parent.recv()
    proc, clients = psutil.Process(pid), []
    for i in range(2):
        mine, theirs = ctx.Pipe()
        c = ctx.Process(target=client_main, args=(port, streams // 2 + (i < streams % 2), seconds, theirs),
                        daemon=True)
        c.start()
        clients.append((c, mine))
    time.sleep(warmup_s)  # the clients' imports and first calls: outside the measured window
    cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
    messages = sum(mine.recv() for _, mine in clients)  # over the whole run: the rate is messages / seconds
    cpu, wall = sum(proc.cpu_times()[:2]) - cpu0, time.monotonic() - t0
    parent.send("stop")
    server.join(5)
    rate = messages / seconds
    return {"mode": mode, "streams": streams, "msgs_s": round(rate), "server_cpu_cores": round(cpu / wall, 2),
            "server_cpu_us_per_msg": round(1e6 * cpu / (rate * wall), 1), "load_avg_1m": round(os.getloadavg()[0], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=512)
    ap.add_argument("--modes", default="gen,write")
    ap.add_argument("--seconds", type=float, default=12.0, help="each client's run")
    ap.add_argument("--warmup-s", type=float, default=4.0)
    args = ap.parse_args()
    print(json.dumps({"settings": vars(args), "cpus": os.cpu_count()}), flush=True)
    for mode in args.modes.split(","):
        print(json.dumps(measure(mode, args.streams, args.seconds, args.warmup_s)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
